"""Hugging Face <-> jdllm checkpoint conversion.

`convert.hf`: writing Hugging Face directories (config.json keys, safetensors).
`convert.io`: `convert_checkpoint` (HF directory -> jdllm checkpoint, atomic).
Reading either kind of directory is the library's: `jdllm.checkpoint`.
`convert.cli`: the `jdllm convert` / `python -m convert` command.
"""
