"""Hugging Face <-> jdllm checkpoint conversion.

`convert.hf`: the families' published tensor names and config.json keys.
`convert.io`: `load_model` (either directory kind) and `convert_checkpoint`.
`convert.cli`: the `jdllm convert` / `python -m convert` command.
"""
