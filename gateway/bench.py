"""`prefixgate bench NAME [args]`: run `benchmarks/bench_NAME.py` with the same Python.

The benchmarks folder is looked up in the current directory first, then beside the installed
`gateway` package (a source checkout). Arguments after NAME go to the benchmark unchanged.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def benchmark_dirs() -> list[Path]:
    """Where benchmarks are looked for, in order."""
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    return [Path.cwd() / "benchmarks", here]


def available() -> list[str]:
    """Names of the benchmarks found."""
    names = {p.stem.removeprefix("bench_") for d in benchmark_dirs() if d.is_dir()
             for p in d.glob("bench_*.py")}
    return sorted(names)


def find(name: str) -> Path | None:
    """The script of benchmark `name`, or None."""
    if not name.replace("_", "").isalnum():
        return None
    for folder in benchmark_dirs():
        path = folder / f"bench_{name}.py"
        if path.is_file():
            return path
    return None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        names = ", ".join(available()) or "none found"
        print(f"usage: prefixgate bench NAME [args]\nbenchmarks: {names}")
        return 0 if args else 2
    path = find(args[0])
    if path is None:
        names = ", ".join(available()) or "none found"
        print(f"prefixgate bench: no benchmark {args[0]!r} (available: {names})", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(path), *args[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
