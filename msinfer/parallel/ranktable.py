"""HCCL rank tables (format v1.0): generate one for this server, check any, merge several.

HCCL's rank-table launch mode reads RANK_TABLE_FILE to learn every device of the job: its
server, device id, device (RoCE) IP and rank. HCCL expects every value as a string; older tools
wrote numbers, so `validate` names each such value with its server and device.

A table is kept as the plain dict that is written to JSON, so `validate` can take whatever a
file holds and report every problem instead of failing on the first.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess

from ..errors import MsinferError

VERSION = "1.0"
DEFAULT_HCCN_CONF = "/etc/hccn.conf"
HCCN_TOOL = "hccn_tool"
_DIGITS = re.compile(r"0|[1-9][0-9]*")


@dataclasses.dataclass(frozen=True)
class RankDevice:
    """Where one rank runs; a launcher sets DEVICE_ID from device_id."""
    rank: int
    server_id: str
    device_id: int
    device_ip: str | None


# ---- reading the command line's inputs ----

def parse_devices(text: str) -> list[int]:
    """Device ids from `0-3`, `0,1,2,3`, `[0,8)` or `0-1,8-9`: ascending, each once."""
    spec = text.strip()
    half_open = re.fullmatch(r"\[\s*([0-9]+)\s*,\s*([0-9]+)\s*\)", spec)
    if half_open:
        first, end = int(half_open[1]), int(half_open[2])
        if first >= end:
            raise MsinferError(f"devices {text!r}: [{first},{end}) holds no device")
        return list(range(first, end))
    ids = []
    for part in spec.split(","):
        single = re.fullmatch(r"\s*([0-9]+)\s*", part)
        span = re.fullmatch(r"\s*([0-9]+)\s*-\s*([0-9]+)\s*", part)
        if single:
            ids.append(int(single[1]))
        elif span and int(span[1]) <= int(span[2]):
            ids.extend(range(int(span[1]), int(span[2]) + 1))
        else:
            raise MsinferError(
                f"devices {text!r}: cannot read {part.strip()!r}; write 0-3, 0,1,2,3 or [0,4)")
    repeated = sorted({d for d in ids if ids.count(d) > 1})
    if repeated:
        raise MsinferError(f"devices {text!r}: device {_join(repeated)} given twice")
    return sorted(ids)


def split_device_ips(text: str, devices: list[int]) -> dict[int, str]:
    """`--device-ips a,b,c,d`: one address per device, in ascending device order."""
    ips = [ip.strip() for ip in text.split(",")]
    if len(ips) != len(devices):
        raise MsinferError(f"--device-ips has {len(ips)} addresses for {len(devices)} devices "
                           f"({_join(devices)})")
    for ip in ips:
        if not is_ipv4(ip):
            raise MsinferError(f"--device-ips: {ip!r} is not an IPv4 address")
    return dict(zip(devices, ips))


def read_hccn_conf(path: str, devices: list[int]) -> dict[int, str]:
    """Device IPs from the `address_N=IP` lines of an hccn.conf file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MsinferError(f"cannot read {path}: {e}") from None
    found = {}
    for lineno, line in enumerate(lines, 1):
        entry = re.fullmatch(r"\s*address_([0-9]+)\s*=\s*(.*?)\s*", line)
        if entry and int(entry[1]) in devices:
            if not is_ipv4(entry[2]):
                raise MsinferError(
                    f"{path}:{lineno}: address_{entry[1]}={entry[2]!r} is not an IPv4 address")
            found[int(entry[1])] = entry[2]
    missing = [d for d in devices if d not in found]
    if missing:
        raise MsinferError(f"{path} has no address_N= line for device {_join(missing)}")
    return {d: found[d] for d in devices}


def query_hccn_tool(devices: list[int], tool: str = HCCN_TOOL) -> dict[int, str]:
    """Device IPs from `hccn_tool -i N -ip -g`, which prints `ipaddr:IP` and `netmask:...`."""
    ips = {}
    for d in devices:
        command = [tool, "-i", str(d), "-ip", "-g"]
        shown = f"`{HCCN_TOOL} -i {d} -ip -g`"
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MsinferError(f"{shown} failed: {e}") from None
        answer = re.search(r"^\s*ipaddr\s*:\s*(\S+)", done.stdout, re.MULTILINE)
        if done.returncode != 0 or not answer:
            said = (done.stdout + done.stderr).strip()[:200]
            raise MsinferError(
                f"{shown} gave no ipaddr (exit {done.returncode}: {said!r}); give --device-ips "
                f"or --hccn-conf, or --no-device-ip for a job on one 310P server")
        if not is_ipv4(answer[1]):
            raise MsinferError(f"{shown} gave ipaddr {answer[1]!r}, not an IPv4 address")
        ips[d] = answer[1]
    return ips


def find_device_ips(devices: list[int], device_ips: str | None = None,
                    hccn_conf: str | None = None, no_device_ip: bool = False):
    """(device IPs by device or None, where they came from): the IPs given, else the hccn.conf
    given, else hccn_tool on PATH, else /etc/hccn.conf; None (310P, one server) when asked."""
    tool = shutil.which(HCCN_TOOL)
    if no_device_ip:
        return None, ("no device_ip: this table is valid only for a job on this one server "
                      "(310P cards without RoCE addresses)")
    if device_ips:
        return split_device_ips(device_ips, devices), "device IPs from --device-ips"
    if hccn_conf:
        return read_hccn_conf(hccn_conf, devices), f"device IPs from {hccn_conf}"
    if tool:
        return query_hccn_tool(devices, tool), f"device IPs from {tool}"
    if os.path.exists(DEFAULT_HCCN_CONF):
        return (read_hccn_conf(DEFAULT_HCCN_CONF, devices),
                f"device IPs from {DEFAULT_HCCN_CONF}")
    raise MsinferError(
        f"no device IPs: {HCCN_TOOL} is not on PATH and {DEFAULT_HCCN_CONF} does not exist; "
        f"give --device-ips or --hccn-conf, or --no-device-ip for a job on one 310P server")


def host_ip() -> str:
    """This host's address as other servers reach it: the source address of its default route.

    Connecting a UDP socket sends nothing; it only picks the outgoing interface. The host
    name's address is the fallback: on many distributions that is 127.0.1.1.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        raise MsinferError("cannot find this host's address; give --server-ip") from None


# ---- building, checking, merging tables ----

def build(devices: list[int], server_ip: str, device_ips: dict[int, str] | None = None) -> dict:
    """A one-server table; ranks follow ascending device ids. device_ips: {device_id: ip}."""
    devices = sorted(devices)
    if device_ips is not None and set(device_ips) != set(devices):
        raise MsinferError(f"device IPs are for device {_join(sorted(device_ips))}, "
                           f"the table is for device {_join(devices)}")
    entries = []
    for rank, d in enumerate(devices):
        entry = {"device_id": str(d)}
        if device_ips is not None:
            entry["device_ip"] = device_ips[d]
        entry["rank_id"] = str(rank)
        entries.append(entry)
    table = _table([{"server_id": server_ip, "device": entries, "host_nic_ip": "reserve"}])
    source = f"the rank table for server {server_ip}"
    raise_problems(validate(table, source=source), source)
    return table


def default_file_name(table: dict) -> str:
    """hccl_tools' names: `hccl_{N}p_{ids}_{server_ip}.json`, merged `hccl_{S}s_{N}p.json`."""
    servers = table["server_list"]
    ranks = sum(len(s["device"]) for s in servers)
    if len(servers) == 1:
        ids = "".join(d["device_id"] for d in servers[0]["device"])
        return f"hccl_{ranks}p_{ids}_{servers[0]['server_id']}.json"
    return f"hccl_{len(servers)}s_{ranks}p.json"


def validate(table: object, world_size: int | None = None,
             devices_per_server: int | None = None, source: str = "rank table") -> list[str]:
    """Every problem of a parsed table as `source: where: what` lines; [] when HCCL can use it."""
    found = _Findings(source)
    if not isinstance(table, dict):
        found.report("", f"the top level is {_describe(table)}; a rank table is a JSON object")
        return found.problems
    _check_header(table, found)
    servers = _check_server_list(table, found)
    for i, server in enumerate(servers):
        _check_server(i, server, len(servers) > 1, devices_per_server, found)
    _check_rank_numbering(found)
    if found.with_ip and found.without_ip and len(servers) == 1:
        found.report("", f"device_ip is given for {len(found.with_ip)} devices but not for "
                         f"{', '.join(found.without_ip)}; give it for all or (one 310P server "
                         f"only) none")
    if world_size is not None and found.devices != world_size:
        found.report("", f"the table has {found.devices} devices but the strategy's world_size "
                         f"is {world_size}")
    return found.problems


class _Findings:
    """The problems found so far, and what was seen where, for the checks across devices."""

    def __init__(self, source):
        self.source = source
        self.problems = []
        self.server_at = {}   # server_id -> where it first appeared
        self.rank_at = {}     # rank -> where it first appeared
        self.ip_at = {}       # device_ip -> where it first appeared
        self.ranked = []      # (where, rank), for the range check once all devices are counted
        self.with_ip, self.without_ip = [], []
        self.devices = 0

    def report(self, where, what):
        self.problems.append(f"{self.source}: {where}: {what}" if where
                             else f"{self.source}: {what}")


def _check_header(table, found):
    for key, expected in (("version", VERSION), ("status", "completed")):
        if key not in table:
            found.report("", f'no "{key}"; HCCL expects "{expected}"')
        elif table[key] != expected:
            found.report("", f'{key} is {_describe(table[key])}; HCCL expects "{expected}"')


def _check_server_list(table, found):
    """The servers to check one by one ([] when there are none), after their count."""
    servers = table.get("server_list")
    if not isinstance(servers, list) or not servers:
        found.report("", f"server_list is {_describe_list(servers)}; it must list at least one "
                         f"server")
        servers = servers if isinstance(servers, list) else []
    if "server_count" not in table:
        found.report("", f'no "server_count"; it should be "{len(servers)}"')
    else:
        count, wrong = _number(table["server_count"])
        if wrong:
            found.report("", f"server_count {wrong}")
        if count is not None and count != len(servers):
            found.report("", f"server_count is {count} but server_list has {len(servers)} "
                             f"servers")
    return servers


def _check_server(i, server, several_servers, devices_per_server, found):
    here = f"server_list[{i}]"
    if not isinstance(server, dict):
        found.report(here, f"is {_describe(server)}; a server is an object")
        return
    server_id = server.get("server_id")
    if isinstance(server_id, str):
        here = f"server_list[{i}] (server_id {server_id})"
    if "server_id" not in server:
        found.report(here, "no server_id; it is the server's IPv4 address")
    elif _record_unique_ipv4(found.report, here, "server_id", server_id, found.server_at,
                             f"server {server_id} is listed twice (also {{}})"):
        if several_servers and ipaddress.IPv4Address(server_id).is_loopback:
            found.report(here, f"server_id {server_id} is a loopback address; other servers "
                               f"cannot reach it (give --server-ip)")
    devices = server.get("device")
    if not isinstance(devices, list) or not devices:
        found.report(here, f"device is {_describe_list(devices)}; it must list at least one "
                           f"device")
        return
    device_at = {}  # device id on this server -> where it first appeared
    for j, device in enumerate(devices):
        _check_device(f"{here}, device[{j}]", device, several_servers, devices_per_server,
                      device_at, found)


def _check_device(at, device, several_servers, devices_per_server, device_at, found):
    if not isinstance(device, dict):
        found.report(at, f"is {_describe(device)}; a device is an object")
        return
    found.devices += 1
    device_id, wrong = _number(device.get("device_id"))
    if device_id is not None:
        at = f"{at} (device_id {device_id})"
    if "device_id" not in device:
        found.report(at, "no device_id")
    elif wrong:
        found.report(at, f"device_id {wrong}")
    if device_id is not None:
        if devices_per_server is not None and device_id >= devices_per_server:
            found.report(at, f"device_id {device_id} is beyond this hardware's "
                             f"{devices_per_server} devices per server "
                             f"(0..{devices_per_server - 1})")
        if device_id in device_at:
            found.report(at, f"device {device_id} is listed twice on this server "
                             f"(also {device_at[device_id]})")
        else:
            device_at[device_id] = at

    rank, wrong = _number(device.get("rank_id"))
    if "rank_id" not in device:
        found.report(at, "no rank_id")
    elif wrong:
        found.report(at, f"rank_id {wrong}")
    if rank is not None:
        if rank in found.rank_at:
            found.report(at, f"rank {rank} is given twice (also {found.rank_at[rank]})")
        else:
            found.rank_at[rank] = at
        found.ranked.append((at, rank))

    if "device_ip" not in device:
        found.without_ip.append(at)
        if several_servers:
            found.report(at, "no device_ip; a job on several servers needs every device's IP "
                             "(address_N in /etc/hccn.conf)")
        return
    found.with_ip.append(at)
    ip = device["device_ip"]
    _record_unique_ipv4(found.report, at, "device_ip", ip, found.ip_at,
                        f"device_ip {ip} is also the IP of {{}}")


def _check_rank_numbering(found):
    """Ranks are exactly 0..devices-1."""
    for at, rank in found.ranked:
        if rank >= found.devices:
            found.report(at, f"rank_id {rank} is outside 0..{found.devices - 1} "
                             f"(the table has {found.devices} devices)")
    absent = [r for r in range(found.devices) if r not in found.rank_at]
    if absent:
        found.report("", f"rank {_join(absent)} missing; ranks must be exactly "
                         f"0..{found.devices - 1}")


def check_file(path: str, world_size: int | None = None,
               devices_per_server: int | None = None) -> list[str]:
    """Problems of a rank-table file, JSON syntax (with line:column) included; [] when clean."""
    table, problems = parse_file(path)
    if table is _UNPARSED:
        return problems
    return problems + validate(table, world_size, devices_per_server, source=str(path))


def load(path: str) -> dict:
    """A valid table from a file; MsinferError listing every problem otherwise."""
    table, problems = parse_file(path)
    if table is not _UNPARSED:
        problems += validate(table, source=str(path))
    raise_problems(problems, path)
    return table


def merge(tables: list[dict], sources: list[str] | None = None,
          sort_by: str | None = None) -> dict:
    """One table of every server in `tables`, ranks renumbered 0.. in the order given.

    sort_by="server_id" orders the servers by address first. Numbers written by older tools
    (merge_hccl's integer rank ids) are read and written back as strings.
    """
    if sort_by not in (None, "server_id"):
        raise MsinferError(f"cannot sort servers by {sort_by!r}; only by server_id")
    tables = list(tables)
    sources = list(sources) if sources is not None else [
        f"table {n}" for n in range(1, len(tables) + 1)]
    if len(sources) != len(tables):
        raise MsinferError(f"merge: {len(tables)} tables but {len(sources)} source names")
    servers, server_source = [], {}
    for table, source in zip(tables, sources):
        table = _as_strings(table)
        raise_problems(validate(table, source=source), source)
        for server in table["server_list"]:
            server_id = server["server_id"]
            if server_id in server_source:
                raise MsinferError(f"server {server_id} is in both {server_source[server_id]} "
                                   f"and {source}; each server may appear once")
            server_source[server_id] = source
            servers.append(server)
    if sort_by == "server_id":
        servers.sort(key=lambda s: ipaddress.IPv4Address(s["server_id"]))
    rank = 0
    server_list = []
    for server in servers:
        entries = []
        for device in server["device"]:
            entry = {"device_id": device["device_id"]}
            if "device_ip" in device:
                entry["device_ip"] = device["device_ip"]
            entry["rank_id"] = str(rank)
            rank += 1
            entries.append(entry)
        server_list.append({"server_id": server["server_id"], "device": entries,
                            "host_nic_ip": "reserve"})
    merged = _table(server_list)
    raise_problems(validate(merged, source="merged table"), f"the merge of {', '.join(sources)}")
    return merged


def device_for_rank(path_or_table: str | os.PathLike | dict, rank: int | str) -> RankDevice:
    """The server, device id and device IP of `rank` (an int, or a string like RANK_ID's)."""
    if isinstance(path_or_table, dict):
        source = "rank table"
        raise_problems(validate(path_or_table, source=source), source)
        table = path_or_table
    else:
        source = os.fspath(path_or_table)
        table = load(source)
    if isinstance(rank, str) and _DIGITS.fullmatch(rank):
        wanted = int(rank)
    elif isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
        wanted = rank
    else:
        raise MsinferError(f"rank {rank!r} is not a rank number")
    devices = 0
    for server in table["server_list"]:
        for device in server["device"]:
            devices += 1
            if int(device["rank_id"]) == wanted:
                return RankDevice(rank=wanted, server_id=server["server_id"],
                                  device_id=int(device["device_id"]),
                                  device_ip=device.get("device_ip"))
    raise MsinferError(f"{source}: no rank {wanted}; the table has ranks 0..{devices - 1}")


def write(table: dict, path: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(table, indent=4) + "\n")
    except OSError as e:
        raise MsinferError(f"cannot write {path}: {e}") from None



# ---- helpers ----

_UNPARSED = object()


def parse_file(path):
    """(table, problems) of a file; table is _UNPARSED when it is not JSON at all."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise MsinferError(f"cannot read rank table {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _UNPARSED, [f"{path}: not UTF-8 text (byte {e.start})"]
    problems = []

    def refuse_repeated_keys(pairs):
        # JSON readers keep one of two equal keys silently; a hand-edited table can hide a value.
        keys = [k for k, _ in pairs]
        for key in sorted({k for k in keys if keys.count(k) > 1}):
            problems.append(f'{path}: key "{key}" appears twice in one object; readers keep '
                            f"only one of the values")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=refuse_repeated_keys), problems
    except json.JSONDecodeError as e:
        return _UNPARSED, [f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}"]
    except RecursionError:
        return _UNPARSED, [f"{path}: JSON nested too deeply to be a rank table"]


def _table(server_list):
    return {"version": VERSION, "server_count": str(len(server_list)),
            "server_list": server_list, "status": "completed"}


def _as_strings(table):
    """A copy with the integer counts and ids of older tools turned into strings."""
    def fix(value):
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(table, dict):
        return table
    table = json.loads(json.dumps(table))
    if "server_count" in table:
        table["server_count"] = fix(table["server_count"])
    for server in table.get("server_list") or []:
        for device in (server.get("device") or []) if isinstance(server, dict) else []:
            if isinstance(device, dict):
                for key in ("device_id", "rank_id"):
                    if key in device:
                        device[key] = fix(device[key])
    return table


def _number(value):
    """(number, complaint) of an id written as a string of digits.

    A bare JSON integer still yields its number, so the other checks go on, plus a complaint.
    """
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        return int(value), None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value, f'is {value} (a number); HCCL expects the string "{value}"'
    return None, f"is {_describe(value)}; expected a string of digits such as \"0\""


def _describe(value):
    if isinstance(value, str):
        shown = json.dumps(value)
        return shown if len(shown) <= 40 else shown[:37] + '..."'
    if isinstance(value, bool):
        return f"{json.dumps(value)} (a boolean)"
    if isinstance(value, (int, float)):
        return f"{value} (a number)"
    if value is None:
        return "null"
    return "a list" if isinstance(value, list) else "an object"


def _describe_list(value):
    if value is None:
        return "missing"
    return "empty" if value == [] else _describe(value)


def _record_unique_ipv4(report, at, field, value, seen, duplicate):
    """Report `value` unless it is a string IPv4 address not in `seen` (then record it at
    `at` and return True). `duplicate` names the clash, `{}` standing for the first place."""
    if not isinstance(value, str):
        report(at, f"{field} is {_describe(value)}; HCCL expects a string")
    elif not is_ipv4(value):
        report(at, f"{field} {value!r} is not an IPv4 address")
    elif value in seen:
        report(at, duplicate.format(seen[value]))
    else:
        seen[value] = at
        return True
    return False


def is_ipv4(text):
    if not isinstance(text, str):
        return False
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def _join(numbers):
    return ", ".join(str(n) for n in numbers)


def raise_problems(problems, source):
    if problems:
        raise MsinferError(f"{source} is not a usable rank table:\n  " + "\n  ".join(problems))
