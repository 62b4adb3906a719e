"""What every framework adapter shares, tested without any framework: the store options parsed and
refused in one place (``StoreConfig.from_mapping``), the store they open (``open_store``), and the
framework packages, which import no framework until an adapter is asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_store import fill_keys, key

from uring_kv import BlockStore, StripedBlockStore, SyncBlockStore
from uring_kv.integrations.config import StoreConfig, fingerprint_name, open_store
from uring_kv.testing import id_caches, identify

GOOD = {"root_dir": "/nvme/kv", "capacity_bytes": 1 << 30}


def test_the_options_and_their_defaults() -> None:
    config = StoreConfig.from_mapping({**GOOD, "interface_v1": 1}, owner="Adapter")  # (other keys: the adapter's)
    assert config == StoreConfig(("/nvme/kv",), 1 << 30)
    assert config.engine_options() == {"num_slots": 16} and not config.persistent and config.fsync is None
    striped = StoreConfig.from_mapping({**GOOD, "root_dir": ["/a", "/b"], "persistent": True, "fsync": False,
                                        "num_slots": 8, "io_depth": 4, "direct": False, "io": "threads"},
                                       owner="Adapter")
    assert striped.root_dirs == ("/a", "/b") and striped.paths("kv.bin") == ["/a/kv.bin", "/b/kv.bin"]
    assert striped.persistent and striped.fsync is False
    assert striped.engine_options() == {"num_slots": 8, "io_depth": 4, "direct": False, "io": "threads"}


@pytest.mark.parametrize(("change", "message"), [
    ({"root_dir": None}, r"^Tier: the configuration lacks \['root_dir'\]$"),
    ({"capacity_bytes": None}, r"^Tier: the configuration lacks \['capacity_bytes'\]$"),
    ({"root_dir": ""}, r"^Tier: root_dir must be a directory or a list of them \(one per drive\), got ''$"),
    ({"root_dir": []}, r"^Tier: root_dir must be a directory or a list of them"),
    ({"root_dir": ["/a", 3]}, r"^Tier: root_dir must be a directory or a list of them"),
    ({"capacity_bytes": 0}, r"^Tier: capacity_bytes must be a positive integer, got 0$"),
    ({"capacity_bytes": "1G"}, r"^Tier: capacity_bytes must be a positive integer, got '1G'$"),
    ({"num_slots": True}, r"^Tier: num_slots must be a positive integer, got True$"),
    ({"io_depth": 0}, r"^Tier: io_depth must be a positive integer, got 0$"),
    ({"persistent": "yes"}, r"^Tier: persistent and fsync must be true or false, got 'yes' and None$"),
    ({"persistent": True, "fsync": 1}, r"^Tier: persistent and fsync must be true or false, got True and 1$"),
    ({"fsync": True}, r"^Tier: fsync applies to a persistent tier \(persistent: true\)$"),
    ({"direct": "yes"}, r"^Tier: direct must be true, false or null, got 'yes'$"),
    ({"io": "aio"}, r"^Tier: io must be auto, uring or threads, got 'aio'$"),
])
def test_each_bad_option_is_refused_in_one_line_naming_it(change: dict[str, Any], message: str) -> None:
    options = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        StoreConfig.from_mapping(options, owner="Tier", noun="tier")


def test_open_store_makes_one_file_or_stripes(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=8)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = StoreConfig((str(tmp_path / "a"),), 1 << 20, num_slots=2)
    assert type(open_store(caches, one, "kv.bin", threaded=False)) is BlockStore
    two = StoreConfig((str(tmp_path / "a"), str(tmp_path / "b")), 1 << 20, num_slots=2)
    assert type(open_store(caches, two, "kv.bin", threaded=False)) is StripedBlockStore
    with open_store(caches, two, "kv.bin") as store:
        assert isinstance(store, SyncBlockStore)
        fill_keys(caches, [0, 1, 2, 3], [0, 1, 2, 3])
        store.put([key(0), key(1), key(2), key(3)], [0, 1, 2, 3])
        store.get([key(3)], [5])
        assert identify(caches, 5) == (3, 1, True)
        assert store.stats()["stripes"] == 2


def test_a_persistent_store_keeps_its_rows_under_its_fingerprint(tmp_path: Path) -> None:
    caches = id_caches("cpu", blocks=8)
    config = StoreConfig((str(tmp_path),), 1 << 20, persistent=True, fsync=False, num_slots=2)
    name = fingerprint_name("uring-kv-test", "model A")
    assert name == fingerprint_name("uring-kv-test", "model A") != fingerprint_name("uring-kv-test", "model B")
    with open_store(caches, config, name, fingerprint="model A") as store:
        fill_keys(caches, [0], [0])
        store.put([key(0)], [0])
    assert os.path.exists(tmp_path / name)
    with open_store(caches, config, name, fingerprint="model A") as store:
        assert store.contains(key(0))


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)


def test_the_framework_packages_import_no_framework() -> None:
    """Their configuration paths and benches (which ``uring-kv`` imports to register their commands)
    import nothing of vLLM, SGLang, LMCache, Mooncake or torch until an adapter's name is used or a
    bench runs (this environment has none of the frameworks)."""
    done = _run("import sys, uring_kv.cli, uring_kv.integrations.config\n"
                "for f in ('vllm', 'sglang', 'lmcache', 'mooncake'):\n"
                "    __import__(f'uring_kv.integrations.{f}')\n"
                "    __import__(f'uring_kv.integrations.{f}.bench')\n"
                "heavy = {'vllm', 'sglang', 'lmcache', 'mooncake', 'mooncake.store', 'torch'}\n"
                "print(sorted(heavy & set(sys.modules)))\n"
                "import uring_kv.integrations.vllm as v\n"
                "try:\n"
                "    v.UringKVTier\n"
                "except ImportError as e:\n"
                "    print('needs', e.name)\n"
                "try:\n"
                "    v.NoSuchName\n"
                "except AttributeError as e:\n"
                "    print(e)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "needs vllm",
                                        "module 'uring_kv.integrations.vllm' has no attribute 'NoSuchName'"]


def test_the_mooncake_names_need_no_mooncake_until_a_tier_opens() -> None:
    done = _run("import sys\n"
                "from uring_kv.integrations.mooncake import MooncakeConfig, SyncTieredStore, TieredStore\n"
                "from uring_kv.integrations.mooncake.tiered import TieredStore as T\n"
                "from uring_kv.integrations.mooncake_master import LocalMaster\n"
                "from uring_kv.integrations.mooncake.local import LocalMaster as L\n"
                "print(T is TieredStore, L is LocalMaster, 'mooncake' in sys.modules)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False"]
