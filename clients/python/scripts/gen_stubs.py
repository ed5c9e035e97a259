"""Generates outboxd's gRPC stubs from the repository's proto/ (grpcio-tools).

    python scripts/gen_stubs.py          # rewrite src/outboxd/_proto/
    python scripts/gen_stubs.py --check  # exit 1 if the checked-in stubs are stale

The stubs are checked in (not built at install time) so that installing the package
needs neither grpcio-tools nor the proto tree; CI runs `--check` so they never drift.
grpcio-tools is pinned in pyproject.toml's dev extra: another version writes other bytes.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent
REPO_PROTO = PACKAGE_ROOT.parent.parent / "proto"
PROTO_FILE = "outbox/v1/outbox.proto"
OUT = PACKAGE_ROOT / "src" / "outboxd" / "_proto"
GENERATED = ["outbox_pb2.py", "outbox_pb2.pyi", "outbox_pb2_grpc.py"]
# protoc writes imports relative to the proto root; inside the package they must be absolute.
IMPORT_FROM = "from outbox.v1 import outbox_pb2"
IMPORT_TO = "from outboxd._proto.outbox.v1 import outbox_pb2"


def generate(into: Path) -> dict[str, str]:
    """Runs protoc into `into` and returns the generated files' text by name."""
    wkt = Path(protoc.__file__).resolve().parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{REPO_PROTO}",
            f"-I{wkt}",
            f"--python_out={into}",
            f"--pyi_out={into}",
            f"--grpc_python_out={into}",
            str(REPO_PROTO / PROTO_FILE),
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with {rc}")
    files = {}
    for name in GENERATED:
        text = (into / "outbox" / "v1" / name).read_text()
        files[name] = text.replace(IMPORT_FROM, IMPORT_TO)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
    target = OUT / "outbox" / "v1"
    if args.check:
        stale = []
        for name, text in files.items():
            path = target / name
            current = path.read_text() if path.exists() else ""
            if current != text:
                stale.append(name)
                sys.stdout.writelines(
                    list(
                        difflib.unified_diff(
                            current.splitlines(True), text.splitlines(True), str(path), "generated", n=1
                        )
                    )[:40]
                )
        if stale:
            print(f"stale stubs: {', '.join(stale)}; run python scripts/gen_stubs.py")
            return 1
        print(f"stubs current ({', '.join(files)})")
        return 0
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for pkg in (OUT, OUT / "outbox", target):
        (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (target / name).write_text(text)
    print(f"wrote {', '.join(files)} to {target.relative_to(PACKAGE_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
