"""`hydra-console`: run the operator console, or print one status snapshot for scripts.

    hydra-console                         the default profile (below), else head + 1 peer on this machine
    hydra-console --profile lab           ~/.config/hydra-console/profiles/lab.toml (or a path)
    hydra-console --attach                watch workers that are already running, start nothing
    hydra-console --once --json           one JSON snapshot of the profile's workers (and the last hour's incidents)
    hydra-console incidents --since 2h    the profile's incidents for a postmortem (--json: one JSON list)
    hydra-console --write-profile p.toml  write the profile (default one if none given) and exit

Profile lookup: --profile NAME|PATH; else <config dir>/profiles/default.toml if it exists (where
the console saves the built-in profile); else the built-in head + 1 peer.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path

from ..contracts.errors import UserError
from ..contracts.split import counts_of
from . import display, log_text
from .config import default_profile, load_profile, resolve_profile_path, save_profile
from .incidents import IncidentLog, incidents_path
from .records import State
from .supervisor import Supervisor
from .triage import open_incidents


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hydra-console",
        description="Supervise, watch and steer Hydra workers.",
        epilog=ONCE_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "command", nargs="?", choices=["incidents"], help="incidents: print the profile's recorded incidents, exit"
    )
    ap.add_argument("--since", default="24h", help="with incidents: how far back (90s, 30m, 2h, 7d; default 24h)")
    ap.add_argument("--profile", "-p", default=None, help="profile name or TOML path (default: built-in head + 1 peer)")
    ap.add_argument("--attach", action="store_true", help="monitor workers already running; start and stop nothing")
    ap.add_argument("--readonly", action="store_true", help="watch only: start, stop, restart and apply nothing")
    ap.add_argument("--once", action="store_true", help="poll every worker once, print, exit (starts nothing)")
    ap.add_argument("--json", action="store_true", help="with --once or incidents: print JSON")
    ap.add_argument(
        "--headroom-gb",
        type=float,
        default=None,
        help="GiB every stage must leave free on its card (default: the profile's headroom_gb, 0.5)",
    )
    ap.add_argument("--theme", default=os.environ.get("HYDRA_THEME", "dark"), help="dark, light or colourblind")
    ap.add_argument("--log-dir", default=None, help="folder of the per-worker log files")
    ap.add_argument(
        "--write-profile",
        metavar="PATH",
        default=None,
        help="write the profile as TOML (named after the file) and exit",
    )
    ap.add_argument("--force", action="store_true", help="with --write-profile: overwrite an existing file")
    return ap


ONCE_CODES = """exit status of --once: 0 every worker is ready; 1 a worker is unreachable, starting,
degraded or failing; 2 a usage or profile error."""


def _profile(args):
    if args.profile is not None:
        path = resolve_profile_path(args.profile)
        return load_profile(path), path
    saved = resolve_profile_path("default")
    if saved.exists():
        return load_profile(saved), saved
    return default_profile(), None


RECENT_S = 3600  # the incidents `--once --json` lists


async def _once(sup: Supervisor, as_json: bool) -> str:
    try:
        await sup.poll_once()
    finally:
        await sup.source.aclose()
    healthy = all(w.state == State.READY for w in sup.workers.values())
    if as_json:
        kept = IncidentLog(sup.profile.alerts, incidents_path(sup), writes=False)
        recent, still_open = kept.since(sup.clock() - RECENT_S), open_incidents(kept.since(0))
        plan = await asyncio.to_thread(split_plan_json, sup)
        return display.snapshot_json(sup, recent, still_open, plan), healthy
    now = sup.clock()
    rows = [list(display.WORKER_COLUMNS)] + [display.worker_row(w, sup, now)[0] for w in sup.workers.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows), healthy


def split_plan_json(sup: Supervisor) -> dict:
    """`--once --json`'s `plan`: the running split (else the one a start launches) against every
    worker's card: per worker its need, its card's size and whether it fits, and a split that fits."""
    live = sup.stage_ranges()
    counts = counts_of([r for _, r in live]) if live and len(live) == len(sup.workers) else sup.split
    try:
        plan = sup.plans.plan([(w.spec, w.status) for w in sup.workers.values()], counts, require_card=False)
    except UserError as e:
        return {"error": str(e)}
    return plan.to_json()


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..themes import THEME_ALIASES, THEMES

    theme = THEME_ALIASES.get(args.theme, args.theme)
    if theme not in THEMES:  # in every mode: a script's `--once` is told as the dashboard is
        raise UserError(f"unknown theme {args.theme!r}: choose dark, light or colourblind")
    if args.json and not (args.once or args.command):
        raise UserError("--json needs --once or incidents")
    profile, path = _profile(args)
    if args.headroom_gb is not None:
        if args.headroom_gb < 0:
            raise UserError(f"--headroom-gb must be >= 0, got {args.headroom_gb:g}")
        profile.headroom_gb = args.headroom_gb
    if args.command == "incidents":
        sup = Supervisor(profile, attach=True)
        found = IncidentLog(profile.alerts, incidents_path(sup), writes=False).since(
            sup.clock() - log_text.parse_since(args.since)
        )
        print(
            json.dumps([dataclasses.asdict(i) for i in found], indent=1)
            if args.json
            else "\n".join(log_text.incident_line(i) for i in found) or f"no incidents in the last {args.since}"
        )
        return 0
    if args.write_profile:
        # Named after its file: a copy must not share the original's log and state files.
        target = Path(args.write_profile).expanduser()
        print(save_profile(profile.model_copy(update={"name": target.stem}), target, mkdir=False, overwrite=args.force))
        return 0
    if args.once:
        text, healthy = asyncio.run(_once(Supervisor(profile, attach=True), args.json))
        print(text)
        return 0 if healthy else 1

    from .ui.app import HydraConsole

    sup = Supervisor(
        profile, attach=args.attach, readonly=args.readonly, log_dir=args.log_dir, token=os.environ.get("HYDRA_TOKEN")
    )
    incidents = IncidentLog(profile.alerts, incidents_path(sup), writes=not sup.attach_only)
    app = HydraConsole(sup, readonly=args.readonly, theme=theme, profile_path=path, incidents=incidents)
    try:
        app.run()
    finally:
        sup.kill_all_sync()  # only acts if the app died without stopping its workers
    return app.return_code or 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except UserError as e:
        print(f"hydra-console: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `hydra-console --once --json | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
