"""py_test entry point: runs the test files given as arguments with pytest, after checking that
jax_moe_comm and its native module are the ones Bazel built (from the runfiles), not a copy
installed in the interpreter's site-packages."""

import os
import sys

import pytest

import jax_moe_comm
from jax_moe_comm import native

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)  # the workspace in the runfiles tree
package_dir = os.path.dirname(os.path.abspath(jax_moe_comm.__file__))
if package_dir != os.path.join(root, "jax_moe_comm"):
    sys.exit(f"jax_moe_comm was imported from {package_dir}, not from Bazel's runfiles {root}")
if native.built():
    native_file = os.path.abspath(native._native.__file__)
    print(f"pytest_main: native module {native_file} -> {os.path.realpath(native_file)}")
    if os.path.dirname(native_file) != package_dir:
        sys.exit(f"the native module came from {native_file}, not from Bazel's runfiles")

tests = [os.path.join(root, t) for t in sys.argv[1:]]
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "--rootdir", root] + tests))
