"""`hydra-console`: run the operator console, or print one status snapshot for scripts.

    hydra-console                         head + 1 peer on this machine, default model, even split
    hydra-console --profile lab           ~/.config/hydra-console/profiles/lab.toml (or a path)
    hydra-console --attach                watch workers that are already running, start nothing
    hydra-console --once --json           one JSON snapshot of the profile's workers, then exit
    hydra-console --write-profile p.toml  write the profile (default one if none given) and exit
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ..engine.errors import UserError
from .config import default_profile, load_profile, resolve_profile_path, save_profile
from .supervisor import Supervisor


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hydra-console", description="Supervise, watch and steer Hydra workers.")
    ap.add_argument("--profile", "-p", default=None, help="profile name or TOML path (default: built-in head + 1 peer)")
    ap.add_argument("--attach", action="store_true", help="monitor workers already running; start and stop nothing")
    ap.add_argument("--readonly", action="store_true", help="disable restart, stop and split apply")
    ap.add_argument("--once", action="store_true", help="poll every worker once, print, exit (starts nothing)")
    ap.add_argument("--json", action="store_true", help="with --once: print JSON")
    ap.add_argument("--theme", default=os.environ.get("HYDRA_THEME", "dark"), help="dark, light or colourblind")
    ap.add_argument("--log-dir", default=None, help="folder of the per-worker log files")
    ap.add_argument("--write-profile", metavar="PATH", default=None, help="write the profile as TOML and exit")
    return ap


def _profile(args):
    if args.profile is None:
        return default_profile(), None
    path = resolve_profile_path(args.profile)
    return load_profile(path), path


async def _once(sup: Supervisor, as_json: bool) -> str:
    from . import display

    try:
        await sup.poll_once()
    finally:
        await sup.source.aclose()
    if as_json:
        return display.snapshot_json(sup)
    now = sup.clock()
    rows = [list(display.WORKER_COLUMNS)] + [display.worker_row(w, sup, now)[0] for w in sup.workers.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows)


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.json and not args.once:
        raise UserError("--json needs --once")
    profile, path = _profile(args)
    if args.write_profile:
        print(save_profile(profile, args.write_profile))
        return 0
    if args.once:
        print(asyncio.run(_once(Supervisor(profile, attach=True), args.json)))
        return 0

    from ..themes import THEME_ALIASES, THEMES
    from .ui.app import HydraConsole

    theme = THEME_ALIASES.get(args.theme, args.theme)
    if theme not in THEMES:
        raise UserError(f"unknown theme {args.theme!r}: choose dark, light or colourblind")
    sup = Supervisor(profile, attach=args.attach, log_dir=args.log_dir)
    app = HydraConsole(sup, readonly=args.readonly, theme=theme, profile_path=path)
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
