"""What recording SHA-256 in checkpoint completion marks costs (`train.checkpoint_hashes`), on this CPU.

    python benchmarks/checkpoint_hashes.py --work-dir /tmp/hash_bench --sizes 128MB 1GB --json out.json

For each size it writes a checkpoint laid out as 2 ZeRO-2 ranks leave it (torch.save of fp32 model states,
4 bytes a parameter, and one optimizer shard per rank, 6 bytes a parameter each: master weights and two
Adam moments split in two), then times, best of --repeat:
  save         torch.save of those files (into the page cache, as DeepSpeed writes them: no fsync);
  hash 1 proc  dstrain.checkpoints.record_file over every file in one process, files still cached;
  hash 2 ranks the same split by assign_files over 2 processes, as 2 ranks do right after saving;
  verify cold  check_tag(hashes=True) (threads) after the files were dropped from the page cache
               (fsync + posix_fadvise DONTNEED): `dstrain checkpoint verify` or a resume with
               train.verify_hashes_on_resume reading from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from multiprocessing import get_context
from pathlib import Path

from dstrain.checkpoints import COMPLETE_MARK, assign_files, check_tag, record_file


def parse_size(text: str) -> int:
    units = {"MB": 10**6, "GB": 10**9}
    return int(float(text[:-2]) * units[text[-2:].upper()])


def checkpoint_states(total_bytes: int) -> dict[str, dict]:
    """A 2-rank ZeRO-2 layout of about `total_bytes`: {file name: what torch.save writes to it}."""
    import torch
    params = total_bytes // 16
    states = {"mp_rank_00_model_states.pt": {"module": {"weight": torch.randn(params)}}}
    for rank in range(2):
        shard = {name: torch.randn(params // 2) for name in ("fp32", "exp_avg", "exp_avg_sq")}
        states[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = {"optimizer_state_dict": shard}
    return states


def write_checkpoint(tag_dir: Path, states: dict[str, dict]) -> None:
    import torch
    tag_dir.mkdir(parents=True, exist_ok=True)
    for name, state in states.items():
        torch.save(state, tag_dir / name)


def hash_share(args: tuple[str, list[str]]) -> None:
    tag_dir, names = args
    for name in names:
        record_file(Path(tag_dir) / name, with_hash=True)


def drop_from_page_cache(tag_dir: Path) -> None:
    for path in tag_dir.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def best(repeat: int, run, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before:
            before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(work_dir: Path, total_bytes: int, repeat: int) -> dict:
    tag_dir = work_dir / "step00000001"
    shutil.rmtree(tag_dir, ignore_errors=True)
    states = checkpoint_states(total_bytes)
    save = best(repeat, lambda: write_checkpoint(tag_dir, states))
    states.clear()  # free the tensors before hashing
    sizes = {p.name: p.stat().st_size for p in tag_dir.iterdir()}
    size = sum(sizes.values())
    one = best(repeat, lambda: hash_share((str(tag_dir), list(sizes))))
    shares = assign_files([sizes, sizes])
    with get_context("fork").Pool(2) as pool:
        two = best(repeat, lambda: pool.map(hash_share, [(str(tag_dir), names) for names in shares]))
    files = {name: record_file(tag_dir / name, with_hash=True) for name in sizes}
    (tag_dir / COMPLETE_MARK).write_text(json.dumps({"step": 1, "world_size": 2, "time": 1.0, "files": files}))
    cold = best(repeat, lambda: check_tag(tag_dir, hashes=True), before=lambda: drop_from_page_cache(tag_dir))
    shutil.rmtree(tag_dir)
    return {"bytes": size, "save_s": save, "hash_1proc_s": one, "hash_2ranks_s": two, "verify_cold_s": cold,
            "hash_2ranks_over_save": two / save}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/dstrain_hash_bench"))
    parser.add_argument("--sizes", nargs="+", default=["128MB", "1GB"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    import torch
    rows = [measure(args.work_dir, parse_size(s), args.repeat) for s in args.sizes]
    print(f"{'checkpoint':>10} {'save':>8} {'hash 1 proc':>12} {'hash 2 ranks':>13} {'verify cold':>12} "
          f"{'2 ranks/save':>13}")
    for row in rows:
        print(f"{row['bytes'] / 1e6:8.0f}MB {row['save_s']:7.2f}s {row['hash_1proc_s']:11.2f}s "
              f"{row['hash_2ranks_s']:12.2f}s {row['verify_cold_s']:11.2f}s {row['hash_2ranks_over_save']:12.2f}x")
    if args.json:
        facts = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpu": _cpu_name(),
                 "cores": os.cpu_count(), "load_average_at_end": os.getloadavg(), "python": platform.python_version(),
                 "torch": torch.__version__,
                 "command": "python benchmarks/checkpoint_hashes.py " + " ".join(sys.argv[1:]),
                 "rows": rows}
        args.json.write_text(json.dumps(facts, indent=1) + "\n")


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
