"""`pagoda top`: the /kv view in a terminal, against any pod URL (a port-forward, a Service, localhost).

Polls `GET /kv/state` and redraws: headline numbers, the roofline of the last step, the block grid
(one character per block), the running requests with their block tables, and the newest events.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

HELP = "watch a serving pod's KV cache and step roofline live in the terminal"
BLOCK_CHARS = {"free": "·", "cached": "░", "used": "█"}
EVENT_LABELS = {"alloc": "alloc", "cache": "hashed", "prefix_hit": "prefix hit", "fork": "fork",
                "cow": "copy-on-write", "free": "free", "evict": "evict", "preempt": "preempt"}  # fmt: skip
PALETTE = ("magenta", "cyan", "green", "yellow", "blue", "red", "bright_magenta", "bright_cyan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the pod's base URL")
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"), help="the pod's --api-key")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")


def fetch_state(url: str, api_key: str | None) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/kv/state")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def _si(value: float, unit: str) -> str:
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(value) < 1000 or prefix == "P":
            return f"{value:.3g} {prefix}{unit}"
        value /= 1000
    return ""


def _colour(owner: str | None, colours: dict[str, str]) -> str:
    if owner is None:
        return "grey50"
    return colours.setdefault(owner, PALETTE[len(colours) % len(PALETTE)])


def render_frame(state: dict[str, Any], width: int = 100):
    """One screen of the view, as a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    h, r = state["headline"], state["roofline"]
    colours: dict[str, str] = {}
    head = Text.assemble(
        ("pagoda top ", "bold"), f"· {state['model']} · step {state['step']}\n",
        ("blocks in use ", "dim"), (f"{h['blocks_used']}/{state['num_blocks']}", "bold"),
        f"  ({h['blocks_cached']} cached, {h['blocks_free']} free, {h['blocks_shared']} shared)  ",
        ("usage ", "dim"), (f"{h['usage']:.1%}", "bold red" if h["usage"] > h["usage_target"] else "bold"),
        f" vs target {h['usage_target']:.0%}  ",
        ("capacity ", "dim"), f"{h['capacity_tokens']:,} tokens",
        f" = {h['capacity_seqs_at_mean_len'] or '–'} seqs at mean length  ",
        ("waste ", "dim"), f"{h['waste_pct']:.1f}% ({h['waste_slots']} slots)\n",
    )  # fmt: skip
    step = r["last_step"]
    if step:
        head.append_text(Text.assemble(
            ("last step ", "dim"), (f"{step['bound']}-bound", "bold"),
            f": {step['tokens']} tokens in {step['seconds'] * 1000:.1f} ms, {_si(step['bytes_per_s'], 'B/s')} "
            f"({step['bandwidth_utilization']:.1%} of peak), {_si(step['flops_per_s'], 'FLOP/s')} "
            f"({step['compute_utilization']:.1%} of peak), {step['intensity']:.2f} FLOP/B vs ridge "
            f"{r['ridge_intensity']:.1f}\n",
        ))  # fmt: skip
    counters = state["counters"]
    head.append_text(Text.assemble(
        ("events ", "dim"),
        " · ".join(f"{label} {counters[kind + '_events']}" for kind, label in EVENT_LABELS.items()),
        f" · dropped {counters['events_dropped']}\n",
    ))  # fmt: skip
    grid = Text()
    blocks = state["blocks"]
    for i, kind in enumerate(blocks["state"][: width * 8]):
        ref = blocks["ref_count"][i]
        char = str(min(ref, 9)) if ref > 1 else BLOCK_CHARS[kind]
        grid.append(char, style=_colour(blocks["owner"][i], colours) if kind == "used" else "grey50")
        if (i + 1) % width == 0:
            grid.append("\n")
    requests = Table("request", "status", "prompt", "output", "held", "prefix hit", "block table", box=None)
    for request in state["requests"]:
        for seq in request["seqs"]:
            table = " ".join(f"{logical}→{physical}" for logical, physical in enumerate(seq["block_table"]))
            requests.add_row(
                Text(request["id"] + (f" #{seq['index']}" if len(request["seqs"]) > 1 else ""),
                     style=_colour(request["id"], colours)),
                request["status"], str(seq["prompt_tokens"]), str(seq["output_tokens"]),
                f"{seq['tokens_in_cache']} (+{seq['empty_slots']} empty)",
                str(request["prefix_hit_tokens"] or "–"), table[: max(20, width - 60)],
            )  # fmt: skip
    log = Table("step", "event", "what just happened", "the paper calls it", box=None)
    for event in reversed(state["recent_events"][-10:]):
        who = f" {event['req']}" if event.get("req") else ""
        meaning = state["kinds"][event["kind"]]
        log.add_row(str(event["step"]), event["kind"] + who, meaning["what"], meaning["term"])
    return Group(head, grid, Text(""), requests, Text(""), log)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        state = fetch_state(args.url, args.api_key)
    except (urllib.error.URLError, OSError) as error:
        console.print(f"[red]cannot read {args.url}/kv/state: {error}[/red]")
        return 1
    if args.once:
        console.print(render_frame(state, console.width))
        return 0
    with Live(render_frame(state, console.width), console=console, screen=True, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                try:
                    state = fetch_state(args.url, args.api_key)
                except (urllib.error.URLError, OSError):
                    continue  # the pod restarts or the port-forward blinks: keep the last frame
                live.update(render_frame(state, console.width), refresh=True)
        except KeyboardInterrupt:
            return 0
