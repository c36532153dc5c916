"""pyllama_pp.devices: device spec parsing and the device kinds (pure Python, no variant loaded)."""
from __future__ import annotations

import json
import socket

import pytest

from pyllama_pp import DeviceSpecError, devices
from pyllama_pp.devices import VDevConfig, parse, parse_rate, parse_size
from pyllama_pp.devices.base import DeviceSpec, forms

MiB, GiB = 1024**2, 1024**3


# --- sizes and rates -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("768MiB", 768 * MiB), ("2GiB", 2 * GiB), ("1.5GiB", int(1.5 * GiB)), ("64mib", 64 * MiB),
    ("1GB", 10**9), ("250MB", 250 * 10**6), ("4k", 4096), ("4KiB", 4096), ("1000", 1000), ("0", 0),
    (12345, 12345), (" 3 MiB ", 3 * MiB), ("2G", 2 * GiB), ("1TiB", 1024**4),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text,want", [
    ("4GBps", 4.0), ("250MBps", 0.25), ("0.25GBps", 0.25), ("4gb/s", 4.0), ("500mb/s", 0.5), ("4", 4.0),
    (2, 2.0), (0.5, 0.5), ("0", 0.0),
])
def test_parse_rate(text, want):
    assert parse_rate(text) == pytest.approx(want)


@pytest.mark.parametrize("bad", ["lots", "12XB", "MiB", "-1MiB", "1.2.3GiB"])
def test_parse_size_rejects(bad):
    with pytest.raises(DeviceSpecError, match="memory size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["fast", "4Gbits", "4GiBps", "-4GBps"])
def test_parse_rate_rejects(bad):
    with pytest.raises(DeviceSpecError, match="bandwidth"):
        parse_rate(bad)


# --- string forms ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["cpu", "CPU", " cpu ", "", None])
def test_cpu(text):
    s = parse(text)
    assert s.kind == "cpu" and s.vdevs == [] and s.cuda_ids == []


def test_cuda_forms():
    s = parse("cuda")
    assert s.kind == "cuda" and s.cuda_ids == []
    s = parse("cuda:0,1")
    assert s.kind == "cuda" and s.cuda_ids == [0, 1] and s.n_devices == 2
    assert parse("cuda:1,0").cuda_ids == [1, 0], "the order given is the order used"
    assert parse("CUDA:3").cuda_ids == [3]


@pytest.mark.parametrize("n", [1, 2, 3, 16])
def test_vdev_counts(n):
    s = parse(f"vdev:{n}x0@0")
    assert s.kind == "vdev" and s.n_devices == n == len(s.vdevs)
    assert all(v == VDevConfig() for v in s.vdevs), "0 memory and 0 GB/s are the unlimited/unthrottled defaults"


def test_vdev_memory_and_dedicated_links():
    s = parse("vdev:2x768MiB@4GBps")
    assert [v.memory for v in s.vdevs] == [768 * MiB] * 2
    assert [v.link_gbps for v in s.vdevs] == [4.0, 4.0]
    assert [v.link_group for v in s.vdevs] == [-1, -1], "each device on its own link by default"
    assert [v.speed for v in s.vdevs] == [1.0, 1.0]
    assert str(s) == "vdev:2x768MiB@4GBps"


def test_vdev_memory_units_and_rates():
    assert parse("vdev:2x64MiB@0.25GBps").vdevs[0].memory == 64 * MiB
    assert parse("vdev:2x64MiB@0.25GBps").vdevs[1].link_gbps == pytest.approx(0.25)
    assert parse("vdev:2x1.5GiB@250MBps").vdevs[0].memory == int(1.5 * GiB)
    assert parse("vdev:2x1.5GiB@250MBps").vdevs[0].link_gbps == pytest.approx(0.25)
    assert parse("vdev:1x1000000").vdevs[0].memory == 10**6, "plain numbers are bytes"
    v = parse("vdev:2x768MiB").vdevs[0]
    assert v.link_gbps == 0.0, "no @rate: unthrottled"
    assert parse("VDEV:2X768MIB@4GBPS").vdevs[0] == parse("vdev:2x768MiB@4GBps").vdevs[0], "case-insensitive"


def test_vdev_shared_link():
    s = parse("vdev:2x768MiB@4GBps,shared")
    groups = {v.link_group for v in s.vdevs}
    assert len(groups) == 1 and groups.pop() >= 0, "shared: one link group >= 0 for all devices"
    assert [v.link_gbps for v in s.vdevs] == [4.0, 4.0]


def test_vdev_speeds_and_threads():
    s = parse("vdev:2x768MiB@4GBps,speed=1:2")
    assert [v.speed for v in s.vdevs] == [1.0, 2.0]
    assert [v.link_group for v in s.vdevs] == [-1, -1]
    s = parse("vdev:3x0@0,shared,speed=1:1.5:3,threads=2")
    assert [v.speed for v in s.vdevs] == [1.0, 1.5, 3.0]
    assert [v.threads for v in s.vdevs] == [2, 2, 2]
    assert len({v.link_group for v in s.vdevs}) == 1 and s.vdevs[0].link_group >= 0


def test_vdev_direct_read_share():
    assert [v.direct_read for v in parse("vdev:2x0@1").vdevs] == [0.5, 0.5]   # the default
    assert [v.direct_read for v in parse("vdev:2x0@1,shared,direct=0.25").vdevs] == [0.25, 0.25]
    assert parse({"kind": "vdev", "devices": [{"direct_read": 1}]}).vdevs[0].direct_read == 1.0
    with pytest.raises(DeviceSpecError, match="device 0: direct_read takes a number in"):
        parse({"kind": "vdev", "devices": [{"direct_read": 2}]})


def test_vdev_row_pad():
    """pad=N: alloc sizes with CUDA's row padding of quantized tensors (VRAM as on CUDA); none by default."""
    assert [v.row_pad for v in parse("vdev:2x0@1").vdevs] == [0, 0]
    assert [v.row_pad for v in parse("vdev:2x0@1,shared,pad=512").vdevs] == [512, 512]
    assert parse({"kind": "vdev", "devices": [{"row_pad": 256}]}).vdevs[0].row_pad == 256
    for bad in ("vdev:2x0@1,pad=5000", "vdev:2x0@1,pad=1.5", "vdev:2x0@1,pad=100"):
        with pytest.raises(DeviceSpecError, match="pad takes 0 or a multiple of 256"):
            parse(bad)
    for bad in (-1, True, 512.5, float("inf"), "x"):
        with pytest.raises(DeviceSpecError, match="device 0: row_pad takes 0 or a multiple of 256"):
            parse({"kind": "vdev", "devices": [{"row_pad": bad}]})


# --- JSON forms --------------------------------------------------------------------------------------------

JSON_SPEC = {"kind": "vdev", "devices": [
    {"memory": "768MiB", "link_gbps": 4, "link_group": 0, "speed": 1.0, "threads": 1},
    {"memory": 1024, "link": "250MBps", "link_group": 0, "speed": 2, "threads": 2, "d2d_gbps": "8GBps"},
    {"memory": "1GiB"},
]}


def _check_json_spec(s):
    assert s.kind == "vdev" and s.n_devices == 3
    a, b, c = s.vdevs
    assert (a.memory, a.link_gbps, a.link_group, a.speed, a.threads) == (768 * MiB, 4.0, 0, 1.0, 1)
    assert (b.memory, b.link_gbps, b.link_group, b.speed, b.threads) == (1024, pytest.approx(0.25), 0, 2.0, 2)
    assert b.d2d_gbps == 8.0
    assert c == VDevConfig(memory=GiB), "missing keys take the defaults"


def test_json_dict():
    _check_json_spec(parse(JSON_SPEC))


def test_json_string():
    _check_json_spec(parse(json.dumps(JSON_SPEC)))


def test_json_file(tmp_path):
    p = tmp_path / "devices.json"
    p.write_text(json.dumps(JSON_SPEC))
    s = parse(str(p))
    _check_json_spec(s)
    assert s.text == str(p)


def test_json_other_kinds():
    assert parse({"kind": "cpu"}).kind == "cpu"
    s = parse({"kind": "cuda", "ids": [1, 0]})
    assert s.kind == "cuda" and s.cuda_ids == [1, 0]


def test_parse_passes_a_devicespec_through():
    s = parse("vdev:2x0@0")
    assert parse(s) is s
    assert s.to_dict()["devices"][0]["memory"] == 0


# --- bad specs: DeviceSpecError, and the message lists the accepted forms -----------------------------------

ACCEPTED_MARKERS = ("Accepted forms", "cpu", "cuda:0,1", "vdev:2x768MiB@4GBps", ",shared", "speed=1:2", "JSON")


def _assert_lists_forms(msg: str) -> None:
    for m in ACCEPTED_MARKERS:
        assert m in msg, f"the error does not list the accepted forms ({m!r} missing):\n{msg}"


@pytest.mark.parametrize("bad", [
    "gpu", "cuda:", "cuda:0,0", "cuda:a", "vdev", "vdev:", "vdev:2", "vdev:x768MiB", "vdev:0x768MiB",
    "vdev:17x768MiB", "vdev:2x768MiB@", "vdev:2x768MiB@4GBps,bogus", "vdev:2x768MiB@4GBps,speed=1",
    "vdev:2x768MiB@4GBps,speed=1:0.5", "vdev:2x768MiB@4GBps,shared=1", "vdev:2x768MiB@4GBps;shared",
    "vdev:2x768MiB@4GBps,direct=0", "vdev:2x768MiB@4GBps,direct=1.5", "vdev:2x768MiB@4GBps,direct",
    "{not json", "vdev 2x768MiB",
])
def test_bad_string_specs(bad):
    with pytest.raises(DeviceSpecError) as ei:
        parse(bad)
    msg = str(ei.value)
    # quoted (the list of accepted forms that follows would also contain bare fragments such as "vdev:")
    assert repr(bad.strip()) in msg or repr(bad) in msg, f"the error does not quote the spec:\n{msg}"
    _assert_lists_forms(msg)


@pytest.mark.parametrize("bad", [
    "vdev:2x12XB@4GBps",        # bad memory unit inside an otherwise valid spec
    "vdev:2x768MiB@4Gbits",     # bad bandwidth unit
])
def test_bad_units_inside_a_spec_list_the_forms(bad):
    """A bad unit is a bad spec like any other: the message should quote it and list the forms."""
    with pytest.raises(DeviceSpecError) as ei:
        parse(bad)
    msg = str(ei.value)
    assert bad in msg, f"the error does not quote the spec:\n{msg}"
    _assert_lists_forms(msg)


@pytest.mark.parametrize("bad", [
    {"kind": "tpu"},
    {"kind": "vdev"},
    {"kind": "vdev", "devices": []},
    {"kind": "vdev", "devices": "two"},
    {"kind": "vdev", "devices": [3]},
    {"kind": "vdev", "devices": [{"memroy": "1GiB"}]},
    {"kind": "vdev", "devices": [{"speed": 0.5}]},
    {"kind": "vdev", "devices": [{}] * 17},
])
def test_bad_json_specs(bad):
    with pytest.raises(DeviceSpecError) as ei:
        parse(bad)
    _assert_lists_forms(str(ei.value))


def test_missing_json_file(tmp_path):
    with pytest.raises(DeviceSpecError) as ei:
        parse(str(tmp_path / "nope.json"))
    assert "cannot read" in str(ei.value) and "nope.json" in str(ei.value)
    _assert_lists_forms(str(ei.value))


def test_invalid_json_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{ nope")
    with pytest.raises(DeviceSpecError, match="invalid JSON"):
        parse(str(p))


@pytest.mark.parametrize("dev", [{"memory": -1}, {"memory": "1GiB", "link_gbps": -4}])
def test_negative_numbers_in_json_are_refused(dev):
    """The string form cannot express a negative memory or bandwidth; the JSON form must not either
    (a negative memory cannot be given to the native uint64 budget)."""
    with pytest.raises(DeviceSpecError):
        parse({"kind": "vdev", "devices": [dev, {}]})


def test_device_spec_error_is_a_value_error():
    assert issubclass(DeviceSpecError, ValueError)
    assert "vdev:2x768MiB@4GBps,shared" in devices.FORMS


# --- kinds: each a DeviceSpec subclass in the registry, asked rather than named -------------------------------

def test_each_kind_answers_what_fit_and_the_cli_ask():
    """Accelerators, servers, default margins and links come from the kind: VDEV budgets are exact (no margin) and
    its links are the spec's, split among the devices of a shared link; CUDA and RPC devices take the machine's."""
    cpu, cuda, vdev, rpc = (parse(t) for t in ("cpu", "cuda:0,1", "vdev:3x1GiB@4GBps,shared", "rpc://h:1"))
    assert [s.accelerators for s in (cpu, cuda, vdev, rpc)] == [False, True, True, True]
    assert [s.remote for s in (cpu, cuda, vdev, rpc)] == [False, False, False, True]
    assert [s.default_margin for s in (cuda, vdev, rpc)] == [GiB, 0, GiB]
    assert vdev.link_rates() == [4.0] * 3 and vdev.link_shares() == pytest.approx([4 / 3] * 3)
    assert parse("vdev:2x1GiB@4GBps").link_shares() == [4.0, 4.0], "a link of its own: the whole rate"
    assert [s.link_rates() for s in (cpu, cuda, rpc)] == [None] * 3 and cuda.link_shares() is None
    assert [s.unbuilt({"CPU", "RPC"}) is None for s in (cpu, cuda, vdev, rpc)] == [True, False, True, True]
    assert cuda.unbuilt({"CPU", "CUDA"}) is None


@pytest.mark.parametrize("text,split_mode,match", [
    ("cpu", "layer", "has none"), ("vdev:2x0@0", "layer", "without a memory budget"),
    ("vdev:2x1GiB@1GBps", "row", "split mode row"),
])
def test_fit_check_refuses_what_fit_cannot_plan(text, split_mode, match):
    with pytest.raises(DeviceSpecError, match=match):
        parse(text).fit_check(split_mode)


def test_fit_check_passes_what_fit_can_plan():
    with socket.socket() as server:   # (an rpc server is planned where it answers)
        server.bind(("127.0.0.1", 0))
        server.listen()
        rpc = f"rpc://127.0.0.1:{server.getsockname()[1]}"
        for text, split_mode in (("vdev:2x1GiB@1GBps", "layer"), ("cuda:0,1", "row"), (rpc, "layer")):
            assert parse(text).fit_check(split_mode) is None


def test_the_registry_holds_every_kind_in_the_order_of_the_forms():
    assert list(devices.KINDS) == ["cpu", "cuda", "vdev", "rpc"]
    positions = [devices.FORMS.index(cls.forms.strip().split()[0]) for cls in devices.KINDS.values()]
    assert positions == sorted(positions)
    examples = {"cpu": "cpu", "cuda": "cuda:0", "vdev": "vdev:1x0@0", "rpc": "cuda:0+rpc://h:1"}
    assert {k: type(parse(t)) for k, t in examples.items()} == devices.KINDS


def test_a_kind_is_one_class_and_one_registry_entry(monkeypatch):
    """A new kind: a DeviceSpec subclass with its forms, and its entry in KINDS; parse and the forms find it."""
    class Npu(DeviceSpec):
        kind = "npu"
        forms = "\n  npu                              every NPU"

        @classmethod
        def from_text(cls, text):
            return cls(text=text) if text.lower() == "npu" else None

        @classmethod
        def from_dict(cls, d, text):
            return cls(text=text)

        @property
        def n_devices(self):
            return 0

        def register(self, native, servers=None):
            return "NPU0"

    monkeypatch.setitem(devices.KINDS, "npu", Npu)
    assert type(parse("npu")) is Npu and type(parse({"kind": "npu"})) is Npu
    assert parse("npu").to_dict()["kind"] == "npu" and parse("npu").register(None) == "NPU0"
    assert "every NPU" in forms()
    with pytest.raises(DeviceSpecError, match="every NPU"):
        parse("npu:9")
