"""Build hook: generates the gRPC stubs for retryd.v1 from the .proto contract.

The stubs are never committed. `build_py` runs grpc_tools.protoc (a build
requirement, see pyproject.toml) on `proto/retryd/v1/retryd.proto` and writes
`retryd/v1/retryd_pb2.py`, `.pyi` and `retryd_pb2_grpc.py` into the build tree,
so they land in the wheel beside the hand-written package. The proto root is
found, in order, at $RETRYD_PROTO_ROOT, at ../../proto (this client inside the
retryd repository), or at ./proto (an sdist, which copies it in).

setuptools' intermediate trees (``build/``, ``*.egg-info``) go to a temporary
directory removed when the build step ends, so that ``pip install
./clients/python`` leaves the checkout as it found it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO_FILE = "retryd/v1/retryd.proto"


def proto_root() -> Path:
    candidates = []
    if os.environ.get("RETRYD_PROTO_ROOT"):
        candidates.append(Path(os.environ["RETRYD_PROTO_ROOT"]))
    candidates += [HERE.parent.parent / "proto", HERE / "proto"]
    for candidate in candidates:
        if (candidate / PROTO_FILE).is_file():
            return candidate
    raise RuntimeError(
        f"cannot find {PROTO_FILE}; looked in {', '.join(map(str, candidates))} "
        "(set RETRYD_PROTO_ROOT)"
    )


def generate_stubs(out_dir: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    root = proto_root()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(root / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {root / PROTO_FILE}")
    init = out_dir / "retryd" / "v1" / "__init__.py"
    init.write_text('"""Generated from proto/retryd/v1/retryd.proto at build time."""\n')


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        # An editable install serves src/ directly, so generate there
        # (git-ignored); a regular build writes into the build tree.
        target = HERE / "src" if getattr(self, "editable_mode", False) else Path(self.build_lib)
        generate_stubs(target)


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        destination = Path(base_dir) / "proto" / "retryd" / "v1"
        destination.mkdir(parents=True, exist_ok=True)
        shutil.copy(proto_root() / PROTO_FILE, destination / "retryd.proto")


def scratch_directory() -> Path:
    """A temporary directory for setuptools' own build trees, removed when this process exits."""
    scratch = Path(tempfile.mkdtemp(prefix="retryd-client-build-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


SCRATCH = scratch_directory()

setup(
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto},
    # Defaults only: a command line (`setup.py build --build-base ...`) still wins.
    options={"build": {"build_base": str(SCRATCH / "build")}, "egg_info": {"egg_base": str(SCRATCH)}},
)
