"""The build: the liburing finder (a pure function) and the static link of the installed module."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

import uring_kv._native_c as native_c

ROOT = Path(__file__).resolve().parent.parent


def load_build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_ffi_under_test", ROOT / "build_ffi.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_build_script()


def exists_in(*paths: str) -> object:
    return lambda p: p in paths


def test_env_prefix_wins() -> None:
    found = build.find_liburing(
        {"URING_KV_LIBURING": "/kit/usr"}, lambda: ("/pc/include", "/pc/lib"),
        exists_in("/kit/usr/include/liburing.h", "/kit/usr/lib64/liburing.a",
                  "/pc/include/liburing.h", "/pc/lib/liburing.a"))
    assert found == ("/kit/usr/include", "/kit/usr/lib64/liburing.a")


def test_pkg_config_before_system_paths() -> None:
    found = build.find_liburing(
        {}, lambda: ("/opt/uring/include", "/opt/uring/lib"),
        exists_in("/opt/uring/include/liburing.h", "/opt/uring/lib/liburing.a",
                  "/usr/include/liburing.h", "/usr/lib/liburing.a"))
    assert found == ("/opt/uring/include", "/opt/uring/lib/liburing.a")


def test_system_paths_last() -> None:
    found = build.find_liburing({}, lambda: None, exists_in("/usr/local/include/liburing.h",
                                                            "/usr/local/lib/liburing.a"))
    assert found == ("/usr/local/include", "/usr/local/lib/liburing.a")


def test_missing_headers_name_the_package() -> None:
    with pytest.raises(SystemExit, match="install liburing-dev \\(Debian/Ubuntu\\) or liburing-devel"):
        build.find_liburing({}, lambda: None, exists_in())


def test_headers_without_static_archive_say_so() -> None:
    with pytest.raises(SystemExit, match=r"no static liburing\.a"):
        build.find_liburing({}, lambda: None, exists_in("/usr/include/liburing.h", "/usr/lib/liburing.so"))


def test_version_read_from_pkg_config_file() -> None:
    assert build.liburing_version("prefix=/usr\nName: liburing\nVersion: 2.3\nLibs: -luring\n") == "2.3"
    assert build.liburing_version("Name: liburing\n") is None


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd")
def test_installed_module_links_liburing_statically() -> None:
    assert native_c.__file__ is not None
    out = subprocess.run(["ldd", native_c.__file__], capture_output=True, text=True, check=True).stdout
    assert "liburing" not in out
    assert "libcuda" not in out  # the CUDA driver is loaded at run time, only in GPU mode
