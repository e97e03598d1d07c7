"""The "Memory vs compute" dashboard's panels: KV-cache usage beside DCGM GPU utilisation and the roofline."""

from __future__ import annotations

from typing import Any

from dashboard_panels import DCGM_ABSENT, SERVING, Layout, kv_usage_panel, target, text_panel, timeseries

GPU_TEXT = """\
### Why a GPU can read 90% "utilised" while its KV cache is 5% used

**`DCGM_FI_DEV_GPU_UTIL` is not a measure of how full the GPU is.** It is the fraction of time in the
sample window during which *at least one kernel* was running — one small kernel on one of the GPU's
100+ streaming multiprocessors counts as "busy". A serving loop that decodes a single sequence
launches kernels back to back, so the counter reads 90%+ with a batch of one.

**`pagoda_kv_cache_usage_ratio` is how much of the memory reserved for concurrent requests is in
use.** At 5% the pod could hold about twenty times as many tokens in flight.

Decoding is bound by memory bandwidth, not by arithmetic: each step reads all the weights once,
whatever the batch size. Adding sequences to the batch costs little extra time per step, so
throughput grows almost linearly with batch size until the KV cache (or compute) runs out. A pod at
90% "utilisation" and 5% KV usage has most of its capacity left.

**What it means for scaling**
- Do **not** scale on GPU utilisation: it saturates at low load and would add GPUs that the existing
  pods could have absorbed by batching more.
- Scale on **KV-cache usage** and the **waiting queue** (what pagoda's autoscaler does): they rise
  only when a pod really cannot admit more work; preemptions above zero confirm it.
- **Framebuffer use** (`DCGM_FI_DEV_FB_USED`) is also no load signal: the KV pool is allocated at
  start-up, so memory reads nearly full from the first second.

Panels stay empty with a message when the DCGM exporter is absent (e.g. CPU pods).
"""


def dcgm(metric: str) -> str:
    """A DCGM gauge per serving pod. dcgm-exporter attaches the GPU's pod as `pod`/`namespace` when
    scraped with honorLabels, or as `exported_pod`/`exported_namespace` otherwise; accept both."""
    exported = (
        f'label_replace(label_replace({metric}{{exported_namespace=~"$namespace", exported_pod=~"$pod"}}, '
        '"pod", "$1", "exported_pod", "(.+)"), "namespace", "$1", "exported_namespace", "(.+)")'
    )
    # exported_pod="" (absent): otherwise `pod` would be the exporter's own pod.
    direct = f'{metric}{{exported_pod="", namespace=~"$namespace", pod=~"$pod"}}'
    return f"avg by (pod) ({exported} or {direct})"


ROOFLINE_TEXT = """\
### Memory-bound or compute-bound? Why "GPU utilisation" and the roofline can both be true

For every engine step pagoda counts the bytes it **had to move** (every weight once, each sequence's
K/V once, the new K/V written) and the FLOPs it **had to do**, from the model and the step's shape,
and divides by the step's time (formulas: docs/metrics.md).

- **Bandwidth utilisation** = achieved bytes/s ÷ the device's peak bandwidth; **compute
  utilisation** = achieved FLOP/s ÷ peak FLOP/s (datasheet peaks for H200/H100/A100/L4, a start-up
  probe elsewhere).
- A step whose FLOPs per byte (**arithmetic intensity**) are below the device's **ridge** (peak
  FLOP/s ÷ peak bytes/s) is **memory-bound**: no kernel could run it faster than bytes ÷ bandwidth.
  Decode steps at small batch sit far left of the ridge (about 1 FLOP/byte against a ridge of
  ~200 on an H100): the GPU waits on memory.

DCGM's GPU utilisation says only that *a kernel was running*. A decode loop at batch 1 keeps a
kernel running almost all the time (90 % "utilised") while it uses a few % of the compute and,
with a small model, well below the peak bandwidth: both readings are true. Batching more sequences
per step raises the intensity (the weights are read once for all of them) and moves the steps
toward the ridge; the KV-cache usage says how many more sequences fit.

**Time outside the forwards** is the engine loop's busy time not spent in model forwards: scheduling,
sampling, bookkeeping and handing each step's outputs to the server. While it is high the device
waits on its host, whatever the roofline says.
"""


def roofline_panels(grid: Layout) -> None:
    def per_pod_rate(counter: str) -> str:
        return f"sum by (pod) (rate({counter}{{{SERVING}}}[$__rate_interval]))"

    seconds = per_pod_rate("pagoda_step_forward_seconds_total")
    grid.row("memory-bound or compute-bound?")
    grid.add(text_panel("Reading the roofline", ROOFLINE_TEXT), width=10, height=16)
    grid.add(
        timeseries(
            "Bandwidth and compute utilisation vs GPU utilisation",
            "Achieved bytes/s and FLOP/s of the engine steps as fractions of the device's peaks "
            "(pagoda_step_bytes_total, pagoda_step_flops_total over pagoda_step_forward_seconds_total, "
            "divided by pagoda_step_peak_*), beside DCGM_FI_DEV_GPU_UTIL / 100. GPU lines are missing "
            "without the DCGM exporter.",
            [
                target(
                    f"{per_pod_rate('pagoda_step_bytes_total')} / {seconds} / max by (pod) "
                    f"(pagoda_step_peak_bytes_per_second{{{SERVING}}})",
                    "{{pod}} bandwidth",
                    "A",
                ),
                target(
                    f"{per_pod_rate('pagoda_step_flops_total')} / {seconds} / max by (pod) "
                    f"(pagoda_step_peak_flops_per_second{{{SERVING}}})",
                    "{{pod}} compute",
                    "B",
                ),
                target(f"{dcgm('DCGM_FI_DEV_GPU_UTIL')} / 100", "{{pod}} GPU util", "C"),
            ],
            "percentunit",
        ),
        width=14,
    )
    grid.add(
        timeseries(
            "Steps that are memory-bound",
            "Share of engine steps whose arithmetic intensity is below the device's ridge point "
            '(pagoda_step_bound_total{bound="memory"} / all steps).',
            [
                target(
                    f'sum by (pod) (rate(pagoda_step_bound_total{{bound="memory", {SERVING}}}[$__rate_interval]))'
                    f" / {per_pod_rate('pagoda_step_bound_total')}",
                    "{{pod}}",
                    "A",
                )
            ],
            "percentunit",
            max_value=1,
        ),
        width=7,
    )
    grid.add(
        timeseries(
            "Arithmetic intensity vs the ridge (FLOP/byte)",
            "Median FLOPs per byte of the steps (pagoda_step_arithmetic_intensity) and the device's "
            "ridge point, peak FLOP/s / peak bytes/s: below the ridge a step is memory-bound.",
            [
                target(
                    "histogram_quantile(0.5, sum by (pod, le) "
                    f"(rate(pagoda_step_arithmetic_intensity_bucket{{{SERVING}}}[$__rate_interval])))",
                    "{{pod}} median step",
                    "A",
                ),
                target(
                    f"max by (pod) (pagoda_step_peak_flops_per_second{{{SERVING}}}) / max by (pod) "
                    f"(pagoda_step_peak_bytes_per_second{{{SERVING}}})",
                    "{{pod}} ridge",
                    "B",
                ),
            ],
        ),
        width=7,
    )
    busy = per_pod_rate("pagoda_engine_busy_seconds_total")
    grid.add(
        timeseries(
            "Engine loop: time outside the forwards",
            "Shares of the engine loop's busy time (pagoda_engine_busy_seconds_total): not in model forwards "
            "(1 - pagoda_step_forward_seconds_total / busy: scheduling, sampling, bookkeeping, the hand-off), "
            "and handing each step's outputs to the server (pagoda_engine_handoff_seconds_total / busy).",
            [
                target(f"1 - {seconds} / {busy}", "{{pod}} outside the forwards", "A"),
                target(f"{per_pod_rate('pagoda_engine_handoff_seconds_total')} / {busy}", "{{pod}} hand-off", "B"),
            ],
            "percentunit",
            max_value=1,
        ),
        width=10,
    )


def memory_vs_compute_panels() -> list[dict[str, Any]]:
    grid = Layout()
    grid.add(text_panel("Reading these panels", GPU_TEXT), width=10, height=16)
    grid.add(
        timeseries(
            "KV-cache usage vs GPU utilisation",
            "Both as fractions: KV blocks in use (pagoda_kv_cache_usage_ratio) and the share of time a "
            "kernel ran on the pod's GPU (DCGM_FI_DEV_GPU_UTIL / 100). GPU lines are missing without "
            "the DCGM exporter.",
            [
                target(f"max by (pod) (pagoda_kv_cache_usage_ratio{{{SERVING}}})", "{{pod}} KV cache", "A"),
                target(f"{dcgm('DCGM_FI_DEV_GPU_UTIL')} / 100", "{{pod}} GPU util", "B"),
            ],
            "percentunit",
            max_value=1,
        ),
        width=14,
    )
    grid.add(
        timeseries(
            "GPU utilisation (DCGM)",
            "DCGM_FI_DEV_GPU_UTIL: % of time at least one kernel was running. Not a capacity signal.",
            [target(dcgm("DCGM_FI_DEV_GPU_UTIL"), "{{pod}}", "A")],
            "percent",
            max_value=100,
            no_value=DCGM_ABSENT,
        ),
        width=7,
    )
    grid.add(
        timeseries(
            "GPU framebuffer used (DCGM)",
            "DCGM_FI_DEV_FB_USED (MiB): weights + the KV pool, allocated at start-up, plus activations.",
            [target(dcgm("DCGM_FI_DEV_FB_USED"), "{{pod}}", "A")],
            "decmbytes",
            no_value=DCGM_ABSENT,
        ),
        width=7,
    )
    grid.add(kv_usage_panel(), width=12)
    grid.add(
        timeseries(
            "KV blocks used / total",
            "Physical KV blocks referenced by live sequences (pagoda_kv_cache_blocks_used), shared by "
            "several (pagoda_kv_cache_shared_blocks, prefix caching), and the pool size "
            "(pagoda_kv_cache_blocks_total).",
            [
                target(f"sum by (pod) (pagoda_kv_cache_blocks_used{{{SERVING}}})", "{{pod}} used", "A"),
                target(f"sum by (pod) (pagoda_kv_cache_shared_blocks{{{SERVING}}})", "{{pod}} shared", "B"),
                target(f"sum by (pod) (pagoda_kv_cache_blocks_total{{{SERVING}}})", "{{pod}} total", "C"),
            ],
        ),
        width=12,
    )
    roofline_panels(grid)
    return grid.panels
