"""Packaging metadata lives in pyproject.toml; this file only generates the gRPC stubs from
protos/*.proto (with grpcio-tools, a build requirement) whenever the package is built or
installed, editable installs included. The stubs are build outputs: never edit them by hand."""
import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def generate_grpc_stubs():
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    for proto in sorted(glob.glob(os.path.join(ROOT, "protos", "*.proto"))):
        rel = os.path.relpath(proto, ROOT)
        # -I ROOT: the stubs import each other as `protos.<name>_pb2`
        code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={ROOT}",
                            f"--grpc_python_out={ROOT}", proto])
        if code != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {rel}")


class BuildPyWithProtos(build_py):
    def run(self):
        generate_grpc_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
