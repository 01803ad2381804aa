"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kernel_dir(tmp_path_factory):
    """One build directory for the kernel tests of a session (test_qlinear, test_qlinear_i8, test_kquants,
    test_fewer_bit_codes, test_gemma_files, test_native_gemma's activation): each ISA variant of the
    compressed kernels compiles once."""
    return tmp_path_factory.mktemp("kernels")
