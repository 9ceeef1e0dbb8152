"""Rank tables: generate from every IP source, check every finding, merge, look up a rank."""
import copy
import dataclasses
import json
import os
import pathlib
import re
import stat
import sys
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msinfer.cli import main as cli
from msinfer.errors import MsinferError
from msinfer.parallel import ranktable
from msinfer.parallel.ranktable import RankDevice

ROOT = pathlib.Path(__file__).resolve().parents[2]
A_IPS = ["198.51.100.10", "198.51.100.11", "198.51.100.12", "198.51.100.13"]
B_IPS = ["198.51.100.20", "198.51.100.21", "198.51.100.22", "198.51.100.23"]
REGISTERED_SUBCOMMANDS = cli.SUBCOMMANDS  # before the fixture below narrows it


def run(capsys, *argv):
    """`msinfer ranktable ...` in-process: (exit code, stdout, stderr)."""
    code = cli.main(["ranktable", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def only_ranktable_subcommand(monkeypatch):
    # The other subcommand modules are written on other branches; build the parser from ours.
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("ranktable",))


@pytest.fixture
def no_ip_source(monkeypatch, tmp_path):
    """A host with neither hccn_tool on PATH nor /etc/hccn.conf."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(ranktable, "DEFAULT_HCCN_CONF", str(tmp_path / "no-hccn.conf"))


@pytest.fixture
def fake_hccn_tool(monkeypatch, tmp_path):
    """An `hccn_tool` on PATH answering `-i N -ip -g` with 198.51.100.(10+N); logs its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "hccn_tool.log"
    tool = bin_dir / "hccn_tool"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        '[ "$1" = -i ] && [ "$3" = -ip ] && [ "$4" = -g ] || exit 2\n'
        '[ "$2" = 2 ] && [ -n "$FAIL_DEVICE_2" ] && { echo "device 2: no ip" >&2; exit 255; }\n'
        'echo "ipaddr:198.51.100.$((10 + $2))"\n'
        'echo "netmask:255.255.255.0"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(ranktable, "DEFAULT_HCCN_CONF", str(tmp_path / "no-hccn.conf"))
    return log


def hccn_conf(tmp_path, text):
    path = tmp_path / "hccn.conf"
    path.write_text(text)
    return path


def two_servers():
    a = ranktable.build(range(4), "192.0.2.10", dict(enumerate(A_IPS)))
    b = ranktable.build(range(4), "192.0.2.11", dict(enumerate(B_IPS)))
    return ranktable.merge([a, b])


def write_json(path, value):
    path.write_text(json.dumps(value, indent=4))
    return path


# ---- devices ----

@pytest.mark.parametrize("spec, ids", [
    ("0-3", [0, 1, 2, 3]),
    ("0,1,2,3", [0, 1, 2, 3]),
    ("[0,4)", [0, 1, 2, 3]),
    (" [0, 4) ", [0, 1, 2, 3]),
    ("3,1,0,2", [0, 1, 2, 3]),
    ("[8,16)", list(range(8, 16))),
    ("10-13", [10, 11, 12, 13]),
    ("0-1,12", [0, 1, 12]),
    ("7", [7]),
])
def test_device_specs_accept_ranges_lists_and_multi_digit_ids(spec, ids):
    assert ranktable.parse_devices(spec) == ids


@pytest.mark.parametrize("spec, says", [
    ("[4,4)", "holds no device"),
    ("3-1", "cannot read '3-1'"),
    ("0,,1", "cannot read ''"),
    ("a", "cannot read 'a'"),
    ("-1", "cannot read '-1'"),
    ("[0,4]", "cannot read '[0'"),
    ("0-3,2", "device 2 given twice"),
])
def test_bad_device_specs_are_refused_naming_the_part(spec, says):
    with pytest.raises(MsinferError, match="devices") as e:
        ranktable.parse_devices(spec)
    assert says in str(e.value)


def test_multi_digit_devices_keep_their_ids_and_name_the_file_like_hccl_tools(
        capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "generate", "[8,16)", "--server-ip", "192.0.2.10",
                       "--no-device-ip")
    assert code == 0
    name = "hccl_8p_89101112131415_192.0.2.10.json"
    assert f"wrote {name}" in out
    devices = json.loads((tmp_path / name).read_text())["server_list"][0]["device"]
    assert [(d["device_id"], d["rank_id"]) for d in devices] == [
        (str(8 + r), str(r)) for r in range(8)]


# ---- device IP sources ----

def test_device_ips_come_from_the_address_lines_of_hccn_conf(tmp_path):
    path = hccn_conf(tmp_path, "# hccn settings\n"
                               "address_0=198.51.100.10\nnetmask_0=255.255.255.0\n"
                               "address_1 = 198.51.100.11\n"
                               "address_10=198.51.100.20\nnetdetect_10=198.51.100.1\n"
                               "address_11=not-used-here\n")
    assert ranktable.read_hccn_conf(path, [0, 1, 10]) == {
        0: "198.51.100.10", 1: "198.51.100.11", 10: "198.51.100.20"}


def test_hccn_conf_without_a_device_names_the_file_and_the_device(tmp_path):
    path = hccn_conf(tmp_path, "address_0=198.51.100.10\naddress_1=198.51.100.11\n")
    with pytest.raises(MsinferError, match=f"{path} has no address_N= line for device 2, 3"):
        ranktable.read_hccn_conf(path, [0, 1, 2, 3])


def test_hccn_conf_with_a_bad_address_names_the_line(tmp_path):
    path = hccn_conf(tmp_path, "address_0=198.51.100.10\naddress_1=198.51.100.300\n")
    with pytest.raises(MsinferError, match=f"{path}:2: address_1='198.51.100.300' is not an IPv4"):
        ranktable.read_hccn_conf(path, [0, 1])


def test_unreadable_hccn_conf_is_an_error_naming_it(tmp_path):
    with pytest.raises(MsinferError, match="cannot read .*missing.conf"):
        ranktable.read_hccn_conf(tmp_path / "missing.conf", [0])


def test_generate_reads_the_hccn_conf_it_is_given(capsys, tmp_path, fake_hccn_tool):
    path = hccn_conf(tmp_path, "".join(f"address_{d}={ip}\n" for d, ip in enumerate(B_IPS)))
    out_file = tmp_path / "t.json"
    code, out, _ = run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10",
                       "--hccn-conf", str(path), "-o", str(out_file))
    assert code == 0
    assert f"device IPs from {path}" in out
    devices = json.loads(out_file.read_text())["server_list"][0]["device"]
    assert [d["device_ip"] for d in devices] == B_IPS
    assert not fake_hccn_tool.exists()  # the file given wins over hccn_tool on PATH


def test_generate_asks_hccn_tool_on_path_for_each_device(capsys, tmp_path, fake_hccn_tool):
    out_file = tmp_path / "t.json"
    code, out, _ = run(capsys, "generate", "0,1,10,11", "--server-ip", "192.0.2.10",
                       "-o", str(out_file))
    assert code == 0
    assert "device IPs from " in out and "hccn_tool" in out
    assert fake_hccn_tool.read_text().splitlines() == [
        "-i 0 -ip -g", "-i 1 -ip -g", "-i 10 -ip -g", "-i 11 -ip -g"]
    devices = json.loads(out_file.read_text())["server_list"][0]["device"]
    assert [d["device_ip"] for d in devices] == [
        "198.51.100.10", "198.51.100.11", "198.51.100.20", "198.51.100.21"]


def test_hccn_tool_failing_for_a_device_is_an_error_suggesting_the_other_sources(
        capsys, tmp_path, fake_hccn_tool, monkeypatch):
    monkeypatch.setenv("FAIL_DEVICE_2", "1")
    code, _, err = run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10",
                       "-o", str(tmp_path / "t.json"))
    assert code == 2
    assert "`hccn_tool -i 2 -ip -g` gave no ipaddr (exit 255: 'device 2: no ip')" in err
    assert "--no-device-ip" in err
    assert not (tmp_path / "t.json").exists()


def test_generate_takes_explicit_device_ips_in_device_order(capsys, tmp_path, fake_hccn_tool):
    out_file = tmp_path / "t.json"
    code, out, _ = run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10",
                       "--device-ips", ",".join(A_IPS), "-o", str(out_file))
    assert code == 0 and "device IPs from --device-ips" in out
    assert "rank 3: device 3, device_ip 198.51.100.13" in out
    devices = json.loads(out_file.read_text())["server_list"][0]["device"]
    assert [d["device_ip"] for d in devices] == A_IPS


@pytest.mark.parametrize("ips, says", [
    ("198.51.100.10,198.51.100.11", "--device-ips has 2 addresses for 4 devices (0, 1, 2, 3)"),
    ("198.51.100.10,198.51.100.11,198.51.100.12,fe80::1", "'fe80::1' is not an IPv4 address"),
    ("198.51.100.10,198.51.100.11,198.51.100.12,198.51.100.10",
     "device_ip 198.51.100.10 is also the IP of server_list[0] (server_id 192.0.2.10), "
     "device[0] (device_id 0)"),
])
def test_bad_explicit_device_ips_are_refused(capsys, tmp_path, ips, says):
    code, _, err = run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10",
                       "--device-ips", ips, "-o", str(tmp_path / "t.json"))
    assert code == 2 and says in err


def test_no_device_ip_writes_none_and_says_it_is_for_one_server_only(capsys, tmp_path):
    out_file = tmp_path / "t.json"
    code, out, _ = run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10",
                       "--no-device-ip", "-o", str(out_file))
    assert code == 0
    assert "valid only for a job on this one server" in out
    table = json.loads(out_file.read_text())
    assert [sorted(d) for d in table["server_list"][0]["device"]] == [["device_id", "rank_id"]] * 4


def test_without_an_option_or_hccn_tool_generate_reads_etc_hccn_conf(
        capsys, tmp_path, no_ip_source, monkeypatch):
    path = hccn_conf(tmp_path, "".join(f"address_{d}={ip}\n" for d, ip in enumerate(A_IPS)))
    monkeypatch.setattr(ranktable, "DEFAULT_HCCN_CONF", str(path))
    code, out, _ = run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10",
                       "-o", str(tmp_path / "t.json"))
    assert code == 0 and f"device IPs from {path}" in out


def test_with_no_ip_source_at_all_generate_says_what_to_give(capsys, tmp_path, no_ip_source):
    code, _, err = run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10",
                       "-o", str(tmp_path / "t.json"))
    assert code == 2
    assert "hccn_tool is not on PATH" in err and "--no-device-ip" in err


def test_ip_source_options_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        run(capsys, "generate", "0-3", "--no-device-ip", "--device-ips", ",".join(A_IPS))
    assert e.value.code == 2


# ---- server address and file name ----

def test_default_file_name_and_server_ip_are_this_hosts_and_said(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ranktable, "host_ip", lambda: "192.0.2.7")
    code, out, _ = run(capsys, "generate", "0-3", "--no-device-ip")
    assert code == 0
    assert "server_id 192.0.2.7 (this host's address; --server-ip sets another)" in out
    assert "wrote hccl_4p_0123_192.0.2.7.json" in out
    assert json.loads((tmp_path / "hccl_4p_0123_192.0.2.7.json").read_text())[
        "server_list"][0]["server_id"] == "192.0.2.7"


def test_host_ip_is_an_ipv4_address():
    assert ranktable.is_ipv4(ranktable.host_ip())


def test_a_server_ip_that_is_not_ipv4_is_refused(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "0-3", "--server-ip", "node-1", "--no-device-ip",
                       "-o", str(tmp_path / "t.json"))
    assert code == 2 and "--server-ip 'node-1' is not an IPv4 address" in err


def test_generated_file_is_the_v1_format_with_string_values_and_is_deterministic(
        capsys, tmp_path):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path in paths:
        run(capsys, "generate", "0,1", "--server-ip", "192.0.2.10",
            "--device-ips", "198.51.100.10,198.51.100.11", "-o", str(path))
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert json.loads(paths[0].read_text()) == {
        "version": "1.0", "server_count": "1",
        "server_list": [{"server_id": "192.0.2.10", "device": [
            {"device_id": "0", "device_ip": "198.51.100.10", "rank_id": "0"},
            {"device_id": "1", "device_ip": "198.51.100.11", "rank_id": "1"}],
            "host_nic_ip": "reserve"}],
        "status": "completed"}


# ---- merge ----

def test_merge_renumbers_ranks_in_the_order_given(capsys, tmp_path):
    for server, ips in (("192.0.2.10", A_IPS), ("192.0.2.9", B_IPS)):
        run(capsys, "generate", "0-3", "--server-ip", server, "--device-ips", ",".join(ips),
            "-o", str(tmp_path / f"{server}.json"))
    out_file = tmp_path / "m.json"
    code, out, _ = run(capsys, "merge", str(tmp_path / "192.0.2.10.json"),
                       str(tmp_path / "192.0.2.9.json"), "-o", str(out_file))
    assert code == 0
    assert "server 192.0.2.10: ranks 0..3" in out and "server 192.0.2.9: ranks 4..7" in out
    merged = json.loads(out_file.read_text())
    assert merged["server_count"] == "2"
    assert [(s["server_id"], d["device_id"], d["device_ip"], d["rank_id"])
            for s in merged["server_list"] for d in s["device"]] == [
        ("192.0.2.10", str(r), A_IPS[r], str(r)) for r in range(4)] + [
        ("192.0.2.9", str(r), B_IPS[r], str(4 + r)) for r in range(4)]

    code, out, _ = run(capsys, "merge", str(tmp_path / "192.0.2.10.json"),
                       str(tmp_path / "192.0.2.9.json"), "--sort", "server_id",
                       "-o", str(out_file))
    # Sorted as addresses, not as text: .9 before .10.
    assert "server 192.0.2.9: ranks 0..3" in out and "server 192.0.2.10: ranks 4..7" in out


def test_merge_default_file_name_follows_merge_hccl(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for server, ips in (("192.0.2.10", A_IPS), ("192.0.2.11", B_IPS)):
        run(capsys, "generate", "0-3", "--server-ip", server, "--device-ips", ",".join(ips))
    code, out, _ = run(capsys, "merge", "hccl_4p_0123_192.0.2.10.json",
                       "hccl_4p_0123_192.0.2.11.json")
    assert code == 0 and "wrote hccl_2s_8p.json" in out
    assert json.loads((tmp_path / "hccl_2s_8p.json").read_text()) == two_servers()


def test_merge_refuses_a_server_given_twice_naming_both_files(capsys, tmp_path):
    a = write_json(tmp_path / "a.json", ranktable.build(range(4), "192.0.2.10",
                                                        dict(enumerate(A_IPS))))
    b = write_json(tmp_path / "b.json", ranktable.build(range(4), "192.0.2.10",
                                                        dict(enumerate(B_IPS))))
    code, _, err = run(capsys, "merge", str(a), str(b), "-o", str(tmp_path / "m.json"))
    assert code == 2
    assert f"server 192.0.2.10 is in both {a} and {b}" in err


def test_merge_takes_merge_hccl_integer_ranks_and_writes_strings(tmp_path):
    old = two_servers()
    for server in old["server_list"]:
        for device in server["device"]:
            device["rank_id"] = int(device["rank_id"])
    c = ranktable.build([0, 1], "192.0.2.12", {0: "198.51.100.30", 1: "198.51.100.31"})
    merged = ranktable.merge([c, old])
    assert ranktable.validate(merged) == []
    assert [d["rank_id"] for s in merged["server_list"] for d in s["device"]] == [
        str(r) for r in range(10)]


def test_merge_refuses_tables_without_device_ips_for_several_servers():
    a = ranktable.build(range(2), "192.0.2.10")
    b = ranktable.build(range(2), "192.0.2.11")
    with pytest.raises(MsinferError) as e:
        ranktable.merge([a, b], sources=["a.json", "b.json"])
    assert str(e.value).startswith("the merge of a.json, b.json is not a usable rank table")
    assert ("merged table: server_list[0] (server_id 192.0.2.10), device[0] (device_id 0): "
            "no device_ip") in str(e.value)


def test_merge_refuses_a_broken_input_naming_it(tmp_path):
    broken = two_servers()
    del broken["server_list"][1]["device"][0]["device_id"]
    with pytest.raises(MsinferError, match="b.json: server_list.1. .server_id 192.0.2.11., "
                                           "device.0.: no device_id"):
        ranktable.merge([ranktable.build([0], "192.0.2.12", {0: "198.51.100.30"}), broken],
                        sources=["a.json", "b.json"])


def test_merge_of_unparsable_file_names_line_and_column(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0",\n "server_list": [}\n')
    code, _, err = run(capsys, "merge", str(bad), "-o", str(tmp_path / "m.json"))
    assert code == 2 and f"{bad}:2:18: not valid JSON" in err


# ---- check: every finding ----

def check(table, **limits):
    return ranktable.validate(table, source="t.json", **limits)


FIRST_DEVICE = "server_list[0] (server_id 192.0.2.10), device[0] (device_id 0)"
S1 = "t.json: server_list[1] (server_id 192.0.2.11)"
S1D1 = f"{S1}, device[1] (device_id 1)"


def edit(change):
    table = two_servers()
    change(table)
    return table


def dev(table, server, device):
    return table["server_list"][server]["device"][device]


@pytest.mark.parametrize("change, problems", [
    (lambda t: t.pop("version"), ['t.json: no "version"; HCCL expects "1.0"']),
    (lambda t: t.update(version=1.0), ['t.json: version is 1.0 (a number); HCCL expects "1.0"']),
    (lambda t: t.update(status="pending"),
     ['t.json: status is "pending"; HCCL expects "completed"']),
    (lambda t: t.pop("status"), ['t.json: no "status"; HCCL expects "completed"']),
    (lambda t: t.pop("server_count"), ['t.json: no "server_count"; it should be "2"']),
    (lambda t: t.update(server_count="3"),
     ["t.json: server_count is 3 but server_list has 2 servers"]),
    (lambda t: t.update(server_count=2),
     ['t.json: server_count is 2 (a number); HCCL expects the string "2"']),
    (lambda t: t["server_list"][1].update(server_id="192.0.2.10"),
     ["t.json: server_list[1] (server_id 192.0.2.10): server 192.0.2.10 is listed twice "
      "(also server_list[0] (server_id 192.0.2.10))"]),
    (lambda t: t["server_list"][1].update(server_id="node-2"),
     ["t.json: server_list[1] (server_id node-2): server_id 'node-2' is not an IPv4 address"]),
    (lambda t: t["server_list"][1].update(server_id=None),
     ["t.json: server_list[1]: server_id is null; HCCL expects a string"]),
    (lambda t: t["server_list"][1].pop("server_id"),
     ["t.json: server_list[1]: no server_id; it is the server's IPv4 address"]),
    (lambda t: t["server_list"][1].update(server_id="127.0.1.1"),
     ["t.json: server_list[1] (server_id 127.0.1.1): server_id 127.0.1.1 is a loopback "
      "address; other servers cannot reach it (give --server-ip)"]),
    (lambda t: dev(t, 1, 1).update(device_id="0"),
     [f"{S1}, device[1] (device_id 0): device 0 is listed twice on this server "
      "(also server_list[1] (server_id 192.0.2.11), device[0] (device_id 0))"]),
    (lambda t: dev(t, 1, 1).update(device_id="one"),
     [f"{S1}, device[1]: device_id is \"one\"; expected a string of digits such as \"0\""]),
    (lambda t: dev(t, 1, 1).update(device_id="-1"),
     [f"{S1}, device[1]: device_id is \"-1\"; expected a string of digits such as \"0\""]),
    (lambda t: dev(t, 1, 1).update(device_id=1),
     [f'{S1D1}: device_id is 1 (a number); HCCL expects the string "1"']),
    (lambda t: dev(t, 1, 1).pop("device_id"), [f"{S1}, device[1]: no device_id"]),
    (lambda t: dev(t, 1, 1).update(rank_id="0"),
     [f"{S1D1}: rank 0 is given twice (also {FIRST_DEVICE})",
      "t.json: rank 5 missing; ranks must be exactly 0..7"]),
    (lambda t: dev(t, 1, 1).update(rank_id="8"),
     [f"{S1D1}: rank_id 8 is outside 0..7 (the table has 8 devices)",
      "t.json: rank 5 missing; ranks must be exactly 0..7"]),
    (lambda t: dev(t, 1, 1).update(rank_id=5),
     [f'{S1D1}: rank_id is 5 (a number); HCCL expects the string "5"']),
    (lambda t: dev(t, 1, 1).pop("rank_id"),
     [f"{S1D1}: no rank_id", "t.json: rank 5 missing; ranks must be exactly 0..7"]),
    (lambda t: dev(t, 1, 1).update(device_ip="198.51.100.10"),
     [f"{S1D1}: device_ip 198.51.100.10 is also the IP of {FIRST_DEVICE}"]),
    (lambda t: dev(t, 1, 1).update(device_ip="198.51.100.256"),
     [f"{S1D1}: device_ip '198.51.100.256' is not an IPv4 address"]),
    (lambda t: dev(t, 1, 1).update(device_ip=["198.51.100.21"]),
     [f"{S1D1}: device_ip is a list; HCCL expects a string"]),
    (lambda t: dev(t, 1, 1).pop("device_ip"),
     [f"{S1D1}: no device_ip; a job on several servers needs every device's IP "
      "(address_N in /etc/hccn.conf)"]),
    (lambda t: t["server_list"][1].update(device=[]),
     [f"{S1}: device is empty; it must list at least one device"]),
    (lambda t: t["server_list"][1]["device"].__setitem__(1, "1"),
     [f'{S1}, device[1]: is "1"; a device is an object',
      f"{S1}, device[3] (device_id 3): rank_id 7 is outside 0..6 (the table has 7 devices)",
      "t.json: rank 5 missing; ranks must be exactly 0..6"]),
    (lambda t: t["server_list"].__setitem__(1, []),
     ["t.json: server_list[1]: is a list; a server is an object"]),
    (lambda t: t.update(server_list=[]),
     ["t.json: server_list is empty; it must list at least one server",
      "t.json: server_count is 2 but server_list has 0 servers"]),
    (lambda t: t.update(server_list={}),
     ["t.json: server_list is an object; it must list at least one server",
      "t.json: server_count is 2 but server_list has 0 servers"]),
    (lambda t: t.pop("server_list"),
     ["t.json: server_list is missing; it must list at least one server",
      "t.json: server_count is 2 but server_list has 0 servers"]),
])
def test_check_reports_each_finding_naming_server_and_device(change, problems):
    assert check(edit(change)) == problems


def test_check_reports_a_top_level_that_is_not_an_object():
    assert check([two_servers()]) == [
        "t.json: the top level is a list; a rank table is a JSON object"]


def test_check_reports_device_ids_beyond_the_hardware():
    table = edit(lambda t: dev(t, 1, 3).update(device_id="8"))
    assert check(table, devices_per_server=8) == [
        f"{S1}, device[3] (device_id 8): device_id 8 is beyond this hardware's 8 devices per "
        "server (0..7)"]
    assert check(table, devices_per_server=9) == []


def test_check_reports_a_world_size_other_than_the_strategys():
    assert check(two_servers(), world_size=4) == [
        "t.json: the table has 8 devices but the strategy's world_size is 4"]
    assert check(two_servers(), world_size=8) == []


def test_one_server_may_omit_device_ip_for_all_devices_but_not_some():
    table = ranktable.build(range(4), "192.0.2.10")
    assert check(table) == []
    dev(table, 0, 2)["device_ip"] = "198.51.100.12"
    assert check(table) == [
        "t.json: device_ip is given for 1 devices but not for "
        "server_list[0] (server_id 192.0.2.10), device[0] (device_id 0), "
        "server_list[0] (server_id 192.0.2.10), device[1] (device_id 1), "
        "server_list[0] (server_id 192.0.2.10), device[3] (device_id 3); "
        "give it for all or (one 310P server only) none"]


def test_check_reports_every_problem_not_just_the_first(capsys, tmp_path):
    table = two_servers()
    dev(table, 0, 1)["device_ip"] = "198.51.100.999"
    dev(table, 1, 2)["rank_id"] = 6.0
    table["server_list"][1]["server_id"] = "192.0.2.10"
    path = write_json(tmp_path / "t.json", table)
    code, out, _ = run(capsys, "check", str(path))
    assert code == 1
    assert out.splitlines() == [
        f"{path}: server_list[0] (server_id 192.0.2.10), device[1] (device_id 1): "
        "device_ip '198.51.100.999' is not an IPv4 address",
        f"{path}: server_list[1] (server_id 192.0.2.10): server 192.0.2.10 is listed twice "
        "(also server_list[0] (server_id 192.0.2.10))",
        f"{path}: server_list[1] (server_id 192.0.2.10), device[2] (device_id 2): "
        "rank_id is 6.0 (a number); expected a string of digits such as \"0\"",
        f"{path}: rank 6 missing; ranks must be exactly 0..7",
        f"{path}: 4 problems"]


def test_check_names_line_and_column_of_a_json_error(capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{\n  "version": "1.0",\n  "server_count": "1"\n  "server_list": []\n}\n')
    code, out, _ = run(capsys, "check", str(path))
    assert code == 1
    assert out.splitlines()[0] == (
        f"{path}:4:3: not valid JSON: Expecting ',' delimiter")


def test_check_reports_a_key_given_twice_in_one_object(capsys, tmp_path):
    text = json.dumps(ranktable.build([0], "192.0.2.10", {0: "198.51.100.10"}))
    path = tmp_path / "t.json"
    path.write_text(text.replace('"rank_id": "0"', '"rank_id": "0", "rank_id": "1"'))
    code, out, _ = run(capsys, "check", str(path))
    assert code == 1
    assert out.splitlines()[0] == (
        f'{path}: key "rank_id" appears twice in one object; readers keep only one of the values')


def test_check_reports_a_file_that_is_not_utf8(capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_bytes(b'{"version": "\xff"}')
    code, out, _ = run(capsys, "check", str(path))
    assert code == 1 and f"{path}: not UTF-8 text (byte 13)" in out


def test_check_of_a_missing_file_is_a_usage_error(capsys, tmp_path):
    code, _, err = run(capsys, "check", str(tmp_path / "nope.json"))
    assert code == 2 and "cannot read rank table" in err and "nope.json" in err


def test_check_passes_a_clean_table_with_exit_0(capsys, tmp_path):
    path = write_json(tmp_path / "t.json", two_servers())
    code, out, _ = run(capsys, "check", str(path))
    assert (code, out) == (0, f"{path}: ok (2 servers, 8 ranks)\n")


# ---- round trips and the public hccl_tools format ----

def test_generate_then_check_is_clean(capsys, tmp_path, fake_hccn_tool):
    path = tmp_path / "t.json"
    assert run(capsys, "generate", "[0,8)", "--server-ip", "192.0.2.10", "-o", str(path))[0] == 0
    code, out, _ = run(capsys, "check", str(path))
    assert (code, out) == (0, f"{path}: ok (1 server, 8 ranks)\n")


def test_a_merge_hccl_table_with_integer_ranks_is_reported_precisely(capsys, tmp_path):
    # merge_hccl.py renumbers with `device['rank_id'] = rank_id`: integers in the file.
    table = two_servers()
    for server in table["server_list"]:
        for device in server["device"]:
            device["rank_id"] = int(device["rank_id"])
    path = write_json(tmp_path / "hccl_2s_8p.json", table)
    code, out, _ = run(capsys, "check", str(path))
    assert code == 1
    assert out.splitlines() == [
        f"{path}: server_list[{s}] (server_id 192.0.2.1{s}), device[{d}] (device_id {d}): "
        f'rank_id is {4 * s + d} (a number); HCCL expects the string "{4 * s + d}"'
        for s in (0, 1) for d in range(4)] + [f"{path}: 8 problems"]


def test_merge_repairs_a_merge_hccl_table(capsys, tmp_path):
    table = two_servers()
    for server in table["server_list"]:
        for device in server["device"]:
            device["rank_id"] = int(device["rank_id"])
    old = write_json(tmp_path / "old.json", table)
    new = tmp_path / "new.json"
    assert run(capsys, "merge", str(old), "-o", str(new))[0] == 0
    assert json.loads(new.read_text()) == two_servers()


# ---- the rank lookup used by the launcher ----

def test_device_for_rank_finds_server_device_and_ip(tmp_path):
    path = write_json(tmp_path / "t.json", two_servers())
    assert ranktable.device_for_rank(path, 5) == RankDevice(
        rank=5, server_id="192.0.2.11", device_id=1, device_ip="198.51.100.21")
    assert ranktable.device_for_rank(str(path), "0") == RankDevice(
        rank=0, server_id="192.0.2.10", device_id=0, device_ip="198.51.100.10")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ranktable.device_for_rank(path, 5).device_id = 2


def test_device_for_rank_without_device_ips_gives_none():
    table = ranktable.build([8, 9], "192.0.2.10")
    assert ranktable.device_for_rank(table, 1) == RankDevice(1, "192.0.2.10", 9, None)


def test_device_for_rank_of_an_absent_rank_names_the_file(tmp_path):
    path = write_json(tmp_path / "t.json", two_servers())
    with pytest.raises(MsinferError, match=f"{path}: no rank 8; the table has ranks 0..7"):
        ranktable.device_for_rank(path, 8)
    with pytest.raises(MsinferError, match="rank 'x' is not a rank number"):
        ranktable.device_for_rank(path, "x")


def test_device_for_rank_of_an_invalid_table_names_the_file_and_problem(tmp_path):
    path = write_json(tmp_path / "t.json", edit(lambda t: dev(t, 1, 1).update(rank_id=5)))
    with pytest.raises(MsinferError) as e:
        ranktable.device_for_rank(path, 5)
    assert str(e.value).startswith(f"{path} is not a usable rank table:")
    assert f'{path}: server_list[1] (server_id 192.0.2.11), device[1] (device_id 1): rank_id ' \
           f'is 5 (a number)' in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(MsinferError, match=f"{bad}:1:2: not valid JSON"):
        ranktable.device_for_rank(bad, 0)


# ---- properties: check never fails with a traceback; a clean table is usable ----

KEYS = ["version", "server_count", "server_list", "status", "server_id", "device", "device_id",
        "device_ip", "rank_id", "host_nic_ip"]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 20) | st.floats() | st.text(max_size=12)
    | st.sampled_from(["0", "1", "7", "01", "1.0", "completed", "192.0.2.10", "198.51.100.10"]),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5),
    max_leaves=25)


def paths_in(value, path=()):
    yield path
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from paths_in(child, path + (key,))


def at(value, path):
    for key in path:
        value = value[key]
    return value


@st.composite
def mangled_tables(draw):
    """A valid two-server table after a few random deletions, replacements and copies."""
    table = two_servers()
    for _ in range(draw(st.integers(1, 4))):
        paths = list(paths_in(table))
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "copy"]))
        if not path:
            table = draw(JSON) if action == "replace" else table
            continue
        parent, key = at(table, path[:-1]), path[-1]
        if action == "replace":
            parent[key] = draw(JSON)
        elif action == "delete":
            del parent[key]
        elif isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        else:
            parent[key] = copy.deepcopy(at(table, draw(st.sampled_from(paths))))
    return table


def assert_problems_or_usable(table, world_size=None, devices_per_server=None):
    problems = check(table, world_size=world_size, devices_per_server=devices_per_server)
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)
    if not problems:
        ranks = sum(len(server["device"]) for server in table["server_list"])
        found = [ranktable.device_for_rank(table, r) for r in range(ranks)]
        assert len({(f.server_id, f.device_id) for f in found}) == ranks


@settings(max_examples=300, deadline=None)
@given(mangled_tables(), st.none() | st.integers(1, 9), st.none() | st.integers(1, 9))
def test_check_of_a_mangled_table_lists_problems_or_passes_a_usable_table(
        table, world_size, devices_per_server):
    assert_problems_or_usable(table, world_size, devices_per_server)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_check_of_arbitrary_json_lists_problems_or_passes_a_usable_table(value):
    assert_problems_or_usable(value)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()),
                 mangled_tables().map(lambda t: json.dumps(t, indent=1).encode())))
def test_check_command_on_any_file_exits_0_or_1(capsys, tmp_path, content):
    path = tmp_path / "t.json"
    path.write_bytes(content)
    code, out, err = run(capsys, "check", str(path))
    assert err == ""
    last = out.splitlines()[-1]
    if code == 0:
        assert last.startswith(f"{path}: ok (")
    else:
        assert code == 1 and re.fullmatch(rf"{re.escape(str(path))}: \d+ problems?", last)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sets(st.integers(0, 63), min_size=1, max_size=8), min_size=1, max_size=3),
       st.randoms(use_true_random=False))
def test_built_and_merged_tables_are_clean_and_every_rank_maps_back(device_sets, rng):
    ips = iter(f"198.51.100.{n}" for n in rng.sample(range(256), 24))
    servers = [f"192.0.2.{10 + s}" for s in range(len(device_sets))]
    tables = [ranktable.build(devices, server, {d: next(ips) for d in devices})
              for devices, server in zip(device_sets, servers)]
    merged = ranktable.merge(tables)
    assert check(merged) == []
    expected = [(server, d) for devices, server in zip(device_sets, servers)
                for d in sorted(devices)]
    found = [ranktable.device_for_rank(merged, r) for r in range(len(expected))]
    assert [(f.server_id, f.device_id) for f in found] == expected


# ---- --strategy and --hardware ----

def test_check_options_take_world_size_and_devices_per_server_from_those_modules(
        capsys, tmp_path, monkeypatch):
    # Stand-ins with the interface of msinfer.parallel.strategy / msinfer.hardware.
    strategy = types.ModuleType("msinfer.parallel.strategy")
    strategy.load_strategy = lambda path: types.SimpleNamespace(
        world_size={"tp4.yaml": 4, "tp8.yaml": 8}[path])
    hardware = types.ModuleType("msinfer.hardware")
    hardware.get_profile = lambda name: types.SimpleNamespace(
        devices_per_server={"four": 4, "eight": 8}[name])
    monkeypatch.setitem(sys.modules, "msinfer.parallel.strategy", strategy)
    monkeypatch.setitem(sys.modules, "msinfer.hardware", hardware)
    path = write_json(tmp_path / "t.json", ranktable.build([4, 5, 6, 7], "192.0.2.10"))

    assert run(capsys, "check", str(path), "--strategy", "tp4.yaml", "--hardware", "eight")[0] == 0
    code, out, _ = run(capsys, "check", str(path), "--strategy", "tp8.yaml", "--hardware", "four")
    assert code == 1
    assert "the table has 4 devices but the strategy's world_size is 8" in out
    assert "device_id 7 is beyond this hardware's 4 devices per server (0..3)" in out
    assert f"{path}: 5 problems" in out


@pytest.mark.skipif(not (ROOT / "msinfer" / "hardware.py").exists()
                    or not (ROOT / "strategies" / "qwen2_tp4.yaml").exists(),
                    reason="msinfer/hardware.py and strategies/qwen2_tp4.yaml come with the "
                           "strategy/hardware branch")
def test_check_against_the_tp4_strategy_and_atlas_300i_duo(capsys, tmp_path):
    strategy = str(ROOT / "strategies" / "qwen2_tp4.yaml")
    four = write_json(tmp_path / "four.json", ranktable.build(range(4), "192.0.2.10"))
    code, out, _ = run(capsys, "check", str(four), "--strategy", strategy,
                       "--hardware", "atlas-300i-duo")
    assert code == 0, out
    beyond = write_json(tmp_path / "beyond.json", ranktable.build([0, 1, 2, 8], "192.0.2.10"))
    code, out, _ = run(capsys, "check", str(beyond), "--hardware", "atlas-300i-duo")
    assert code == 1 and "device_id 8 is beyond this hardware's 8 devices per server" in out
    code, out, _ = run(capsys, "check", str(write_json(tmp_path / "two.json", two_servers())),
                       "--strategy", strategy)
    assert code == 1 and "the table has 8 devices but the strategy's world_size is 4" in out


# ---- the examples in rank_tables/ ----

def test_the_example_tables_are_what_the_generator_writes(capsys, tmp_path):
    examples = ROOT / "rank_tables"
    run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10", "--device-ips",
        ",".join(A_IPS), "-o", str(tmp_path / "a.json"))
    run(capsys, "generate", "0-3", "--server-ip", "192.0.2.11", "--device-ips",
        ",".join(B_IPS), "-o", str(tmp_path / "b.json"))
    run(capsys, "generate", "0-3", "--server-ip", "192.0.2.10", "--no-device-ip",
        "-o", str(tmp_path / "310p.json"))
    run(capsys, "merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
        "-o", str(tmp_path / "two.json"))
    assert (examples / "hccl_4p_0123_192.0.2.10.json").read_text() == \
        (tmp_path / "a.json").read_text()
    assert (examples / "hccl_4p_0123_192.0.2.10_no_device_ip.json").read_text() == \
        (tmp_path / "310p.json").read_text()
    assert (examples / "hccl_2s_8p.json").read_text() == (tmp_path / "two.json").read_text()


def test_ranktable_is_a_subcommand_of_msinfer():
    assert "ranktable" in REGISTERED_SUBCOMMANDS
