"""How much Python a ZeRO engine runs per training step, phase by phase: cProfile's call counts and times
for the forward, the backward and the optimizer step of dstrain's GPT on one CPU rank (gloo), with the
DeepSpeed JSON dstrain renders for a preset. On a host-bound GPU step these calls are what the GPU waits
for (docs/benchmarks.md, finding 38). Stage 3 gets dstrain's step, unhooked blocks and lean gradient
copies, as the worker does (DSTRAIN_ZERO3_GRADS=off, i.e. speedups.zero3_grads=false: DeepSpeed's copies).

    python3 benchmarks/zero_host_calls.py --preset stage2
    python3 benchmarks/zero_host_calls.py --preset stage2 --lean-bucket   # finding 38's prototype
    torchrun --nproc_per_node 2 benchmarks/zero_host_calls.py --preset stage3 --top 15   # two ranks

Started by torchrun (or the deepspeed launcher) it runs on that many ranks, with the JSON dstrain renders
for that many GPUs, and rank 0 prints. --top N lists the N functions called most in each phase.

--lean-bucket replaces ZeRO-1/2's bucket function (DeepSpeed's reduce_independent_p_g_buckets_and_remove_grads)
with a prototype that keeps its copy and reduction for this set-up (contiguous gradients, no offload, no
MoE) and drops its memory reports, dtype lookups and checks: a measurement, not a dstrain feature.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import time
import types
import warnings


def lean_bucket(optimizer) -> None:
    """The prototype: DeepSpeed's bucket function for one gradient, its common path only."""
    from deepspeed.accelerator import get_accelerator

    accelerator, size, flip = get_accelerator(), optimizer.reduce_bucket_size, optimizer.overlap_comm

    def add_to_bucket(self, param, i):
        numel = param.numel()
        if numel == 0:
            return
        grad = param.grad
        bucket = self.ipg_buckets[self.dtype]
        if bucket.elements + numel > size:
            self.reduce_ipg_grads(comm_dtype=self.dtype)
            if flip:
                bucket.index = 1 - bucket.index
        param_id = self.param_id[id(param)]
        if numel > size:
            self.extra_large_param_to_reduce[self.dtype] = param
        else:
            flat = bucket.buffer[bucket.index].narrow(0, bucket.elements, numel)
            flat.copy_(grad.view(-1))
            grad.data = flat.view_as(grad)
            if self.overlap_comm:
                bucket.copy_streams.add(accelerator.current_stream())
        bucket.elements += numel
        bucket.grads.append(grad)
        bucket.params.append((i, param.param_idx_in_group, param_id))

    optimizer.reduce_independent_p_g_buckets_and_remove_grads = types.MethodType(add_to_bucket, optimizer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="stage2", help="stage1, stage2 or stage3")
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="profiled steps, after 10 unprofiled ones")
    p.add_argument("--lean-bucket", action="store_true")
    p.add_argument("--top", type=int, default=0, help="list the N functions called most in each phase")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a dstrain override, e.g. deepspeed.zero_optimization.stage3_param_persistence_threshold=640 "
                        "(blocks partitioned, as dstrain renders stage3 over 1B parameters on several GPUs)")
    args = p.parse_args()

    warnings.filterwarnings("ignore")
    os.environ["DS_ACCELERATOR"] = "cpu"
    if "WORLD_SIZE" not in os.environ:  # not started by a launcher: one rank
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    import deepspeed
    import torch

    from dstrain.config.resolve import resolve
    from dstrain.models.gpt import GPT
    from dstrain import speedups

    deepspeed.init_distributed(dist_backend="gloo")
    width, vocab, seq, micro = args.d_model, 512, 64, 2
    sets = [f"train.micro_batch_size={micro}", f"model.d_model={width}", f"model.n_layer={args.n_layer}", *args.set]
    # the JSON dstrain renders for WORLD GPUs (blocks whole and fetched as one under ZeRO-3), on CPU ranks
    resolved = resolve(args.preset, None, sets, world_size=world, accelerator="cuda",
                       env={k: v for k, v in os.environ.items() if k.startswith("DSTRAIN_")})  # speedups switches
    ds = resolved.ds_config
    ds.pop("scheduler", None)
    torch.manual_seed(0)
    model = GPT(vocab, seq, width, args.n_layer, 4)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    if ds["zero_optimization"]["stage"] == 3:
        speedups.apply(engine, resolved.config.speedups)
    elif args.lean_bucket:
        lean_bucket(engine.optimizer)

    generator = torch.Generator().manual_seed(0)
    profiles = {phase: cProfile.Profile() for phase in ("forward", "backward", "step")}
    seconds = dict.fromkeys(profiles, 0.0)
    for step in range(10 + args.steps):
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=generator)
        loss = None
        for phase, run in (("forward", lambda: engine((tokens[:, :-1], tokens[:, 1:]))),
                           ("backward", lambda: engine.backward(loss)), ("step", engine.step)):
            started = time.perf_counter()
            if step >= 10:
                profiles[phase].enable()
            out = run()
            if step >= 10:
                profiles[phase].disable()
                seconds[phase] += time.perf_counter() - started
            if phase == "forward":
                loss = out
    if rank != 0:
        return
    print(f"{world} rank(s), {args.preset}, {args.n_layer} layers of width {args.d_model}")
    for phase, profile in profiles.items():
        stats = pstats.Stats(profile, stream=io.StringIO())
        calls = sum(entry[1] for entry in stats.stats.values())
        print(f"{phase:9s} {calls / args.steps:9,.0f} Python calls a step  "
              f"{seconds[phase] / args.steps * 1000:7.1f} ms a step (profiled)")
        # (file, line, name) -> (primitive calls, calls, own time, cumulative time, callers)
        most = sorted(stats.stats.items(), key=lambda item: -item[1][1])[:args.top]
        for (file, line, name), entry in most:
            print(f"    {entry[1] / args.steps:7,.0f}  {name}  ({os.path.basename(file)}:{line})")


if __name__ == "__main__":
    main()
