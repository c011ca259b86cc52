"""Packaging metadata lives in pyproject.toml; this file only generates the gRPC stubs from
protos/*.proto (with grpcio-tools, a build requirement) whenever the package is built or
installed, editable installs included. The stubs are build outputs: never edit them by hand."""
import glob
import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def generate_grpc_stubs():
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tree:
        # the protos folder is installed as raymoe.protos: compiling it from <tree>/raymoe/protos makes the
        # stubs import each other as `raymoe.protos.<name>_pb2`
        staged = os.path.join(tree, "raymoe", "protos")
        os.makedirs(staged)
        for proto in sorted(glob.glob(os.path.join(ROOT, "protos", "*.proto"))):
            shutil.copy(proto, staged)
            rel = os.path.join("raymoe", "protos", os.path.basename(proto))
            code = protoc.main(["grpc_tools.protoc", f"-I{tree}", f"-I{well_known}", f"--python_out={tree}",
                                f"--grpc_python_out={tree}", os.path.join(tree, rel)])
            if code != 0:
                raise RuntimeError(f"grpc_tools.protoc failed on {os.path.relpath(proto, ROOT)}")
        for stub in glob.glob(os.path.join(staged, "*_pb2*.py")):
            shutil.copy(stub, os.path.join(ROOT, "protos"))


class BuildPyWithProtos(build_py):
    def run(self):
        generate_grpc_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
