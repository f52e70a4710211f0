"""Decode one model on a mesh that spans several processes (hosts), with jax.distributed.

Run the same command once per process; every process loads the same checkpoint
into one global ('data', 'model') mesh (each reading only the slices its own
devices hold) and they decode together. Process 0 prints the outputs.

On one machine, two processes with 4 fake CPU devices each (8 devices in all):

    export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4
    python examples/multihost.py --coordinator localhost:12345 --num-processes 2 --process-id 0 &
    python examples/multihost.py --coordinator localhost:12345 --num-processes 2 --process-id 1

On a GPU cluster (one process per host, SLURM fills in the coordinator and ids itself):

    srun --nodes=2 --ntasks-per-node=1 python examples/multihost.py --model /ckpt/llada-8b --mesh data=2,model=8

See README "Scaling out".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-sdar"))
    p.add_argument("--mesh", default=None, help="e.g. data=2,model=4 (default: every device on data)")
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (default: from the cluster)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--prompt-ids", default="3,4,5,6,7;8,9,10", help="';'-separated prompts of token ids")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--json", action="store_true", help="print one JSON line (tokens, step maps, nfe)")
    args = p.parse_args(argv)

    from jdllm import sharding

    kw = {k: v for k, v in dict(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                process_id=args.process_id).items() if v is not None}
    sharding.initialize_distributed(**kw)  # before any other JAX call

    import jax

    import jdllm

    mesh = sharding.make_mesh(args.mesh)
    model = jdllm.load(args.model, dtype="float32", mesh=mesh)
    prompts = [[int(t) for t in row.split(",")] for row in args.prompt_ids.split(";")]
    outs = jdllm.generate(model, prompts, sampling=jdllm.Sampling(
        max_new_tokens=args.max_new_tokens, stop_token_ids=() if args.ignore_eos else None))
    if jax.process_index() == 0:
        if args.json:
            print(json.dumps(dict(processes=jax.process_count(), devices=len(jax.devices()),
                                  mesh=dict(mesh.shape), tokens=[o.token_ids for o in outs],
                                  step_map=[o.step_map for o in outs], nfe=[o.nfe for o in outs])), flush=True)
        else:
            print(f"{jax.process_count()} processes, {len(jax.devices())} devices, mesh {dict(mesh.shape)}")
            for o in outs:
                print(o.token_ids, f"nfe {o.nfe}", o.finish_reason)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
