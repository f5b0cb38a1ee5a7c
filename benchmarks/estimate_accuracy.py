"""How close `dstrain estimate` comes to what the GPU suite measured.

Reads a results file of benchmarks/suite.py, estimates each dstrain row's preset for the same
model, batch and GPU count with dstrain's planner, and prints estimated against measured peak GPU
memory (torch.cuda.max_memory_allocated) and host memory (peak RSS of the largest process).
Costs no device time: the measurements come from the results file.

    python3 benchmarks/estimate_accuracy.py benchmarks/results/2026-11-22-h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30


def compare(results: dict, gpu_mem_gib: float, cpu_mem_gib: float) -> list[dict]:
    from dstrain.tools.estimate.planner import make_plan
    model = results["model"]
    sets = [f"model.n_layer={model['n_layer']}", f"model.d_model={model['d_model']}",
            f"model.n_head={model['n_head']}", f"model.vocab_size={model['vocab_size']}",
            f"data.seq_len={model['seq_len']}", f"train.micro_batch_size={model['micro_batch_per_gpu']}",
            "data.source=synthetic"]
    rows = []
    for row in results["rows"]:
        if row["runner"] != "dstrain" or row.get("variant"):
            continue
        plan = make_plan(None, sets + list(row.get("sets", [])), None, row["gpus"], 1, gpu_mem_gib, cpu_mem_gib, "cuda")
        estimate = next(e for e in plan.estimates if e.name == row["preset"])
        rows.append({"preset": row["preset"], "gpus": row["gpus"],
                     "gpu_estimate_gib": estimate.gpu_bytes_per_gpu / GiB, "gpu_measured_gib": row["peak_gpu_gib"],
                     "host_estimate_gib": estimate.cpu_bytes_per_node / GiB, "host_measured_gib": row["host_rss_gib"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU of the measured machine")
    parser.add_argument("--cpu-mem", type=float, default=128.0, help="GiB of host RAM of the measured machine")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    print(f"{results['device']}; model {results['model']['params']:,} params")
    print(f"{'preset':<16}{'GPU est':>9}{'GPU meas':>10}{'ratio':>7}{'host est':>10}{'host meas':>11}{'ratio':>7}")
    for r in compare(results, args.gpu_mem, args.cpu_mem):
        print(f"{r['preset']:<16}{r['gpu_estimate_gib']:>9.2f}{r['gpu_measured_gib']:>10.2f}"
              f"{r['gpu_estimate_gib'] / r['gpu_measured_gib']:>7.2f}{r['host_estimate_gib']:>10.2f}"
              f"{r['host_measured_gib']:>11.2f}{r['host_estimate_gib'] / r['host_measured_gib']:>7.2f}")


if __name__ == "__main__":
    main()
