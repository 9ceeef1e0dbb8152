"""`msinfer doctor` against fake boxes: an `npu-smi` script first on PATH prints a real-format
300I Duo table (tests/fixtures/npu_smi, layout from Syllo/nvtop#421), a temporary directory
stands in for /usr/local/Ascend, and log files carry the failure lines users reported."""
import json
import os
import platform
import stat

import pytest

from msinfer.cli.main import main
from msinfer.errors import MsinferError
from msinfer.tools import doctor
from msinfer.tools.doctor import parse_npu_smi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "npu_smi")
TP8 = os.path.join(ROOT, "strategies", "qwen2_tp8.yaml")
TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")

# Version files as Ascend writes them: driver and firmware as in Huawei's MindCluster
# installation guide, the toolkit's install info as vllm-ascend bug reports quote it.
DRIVER_INFO = """Version=24.1.rc1
ascendhal_version=7.35.19
aicpu_version=1.0
tdt_version=1.0
log_version=1.0
prof_version=2.0
dvppkernels_version=1.1
tsfw_version=1.0
Innerversion=V100R001C15SPC006B220
compatible_version=[V100R001C30],[V100R001C13],[V100R001C15],[V100R001C17]
compatible_version_fw=[7.0.0,7.2.99]
"""
FIRMWARE_INFO = """Version=7.1.0.11.220
firmware_version=1.0
package_version=23.0.7
compatible_version_drv=[23.0.rc3,23.0.rc3.],[23.0.0,23.0.0.]
"""
TOOLKIT_INFO = """package_name=Ascend-cann-toolkit
version=8.0.RC3
innerversion=V100R001C19SPC001B155
compatible_version=[V100R001C13,V100R001C19],[V100R001C30]
arch={arch}
os=linux
path=/usr/local/Ascend/ascend-toolkit/8.0.RC3/{arch}-linux
"""
# Lines of real failures: vllm-ascend#3479 (sdma copy on 310P), #486 (HCCL EI0006),
# #1993 (300I Duo out of memory).
SDMA_LINE = ("EH9999: Inner Error! rtDeviceSynchronizeWithTimeout execute failed, "
             "reason=[sdma copy error][FUNC:FuncErrorReason][FILE:error_message_manage.cc]")
HCCL_LINE = ("EI0006: [PID: 1292363] 2025-04-08-18:07:20.444.436 Getting socket times out. "
             "Reason: Remote Rank did not send the data in time.")
OOM_LINE = ("EL0004: [PID: 553] 2025-09-17-04:55:13.065.712 Failed to allocate memory.")


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A fake 300I Duo host: returns use(fixture) to pick the npu-smi output it prints."""
    for key in ("RANK_TABLE_FILE", "MSINFER_RANK_TABLE", "MS_ROLE", "MS_WORKER_NUM",
                "MS_SCHED_HOST", "MS_SCHED_PORT", "ASCEND_RT_VISIBLE_DEVICES",
                "ASCEND_TOOLKIT_HOME"):
        monkeypatch.delenv(key, raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ascend = tmp_path / "Ascend"
    arch = platform.machine()
    files = {"driver/version.info": DRIVER_INFO, "firmware/version.info": FIRMWARE_INFO,
             f"ascend-toolkit/latest/{arch}-linux/ascend_toolkit_install.info":
                 TOOLKIT_INFO.format(arch=arch)}
    for name, text in files.items():
        (ascend / name).parent.mkdir(parents=True, exist_ok=True)
        (ascend / name).write_text(text)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(ascend / "ascend-toolkit" / "latest"))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       527923400 kB\nMemAvailable:   503316480 kB\n")
    monkeypatch.setattr(doctor, "MEMINFO", str(meminfo))

    def use(fixture, exit_code=0):
        script = bin_dir / "npu-smi"
        script.write_text(f'#!/bin/sh\n[ "$1" = info ] || exit 2\n'
                          f'cat "{os.path.join(FIXTURES, fixture)}"\nexit {exit_code}\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        return ascend
    return use


def doctor_json(capsys, *args):
    code = main(["doctor", "--json", *args])
    out, err = capsys.readouterr()
    assert out.startswith("{"), err
    report = json.loads(out)
    assert set(report) == {"ok", "checks"}
    for check in report["checks"]:
        assert set(check) == {"name", "status", "detail"}
        assert check["status"] in ("pass", "warn", "fail", "skip")
        assert check["detail"] and "\n" not in check["detail"]
    assert report["ok"] == (code == 0) and code in (0, 1)
    return code, {c["name"]: c for c in report["checks"]}


def rank_table(tmp_path, devices, servers=("10.0.0.1",)):
    server_list = [{"server_id": ip, "host_nic_ip": "reserve",
                    "device": [{"device_id": str(d), "rank_id": str(i * len(devices) + n)}
                               for n, d in enumerate(devices)]}
                   for i, ip in enumerate(servers)]
    if len(servers) > 1:
        for s, server in enumerate(server_list):
            for d in server["device"]:
                d["device_ip"] = f"192.168.{s}.{d['device_id']}"
    path = tmp_path / "hccl.json"
    path.write_text(json.dumps({"version": "1.0", "server_count": str(len(servers)),
                                "server_list": server_list, "status": "completed"}))
    return str(path)


def test_this_cpu_machine_skips_the_device_checks_and_passes(capsys, monkeypatch):
    monkeypatch.delenv("RANK_TABLE_FILE", raising=False)
    monkeypatch.delenv("MS_ROLE", raising=False)
    code, checks = doctor_json(capsys, "--hardware", "cpu", "--model", "qwen2-0.5b")
    assert code == 0
    assert checks["devices"]["status"] == "skip"
    assert checks["software.ascend"]["status"] == "skip"
    assert checks["software.ascend-backend"]["status"] == "skip"
    assert checks["software.mindspore"]["status"] == "pass"
    assert checks["model.plan"]["status"] == "pass"
    assert "float32" in checks["model.plan"]["detail"]
    assert checks["model.host-memory"]["status"] == "skip"


def test_a_healthy_four_card_300i_duo_box_passes_every_check(box, tmp_path, capsys):
    ascend = box("duo_4cards.txt")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "plog-1234_20250101.log").write_text("[INFO] HCCL init ok\n")
    table = rank_table(tmp_path, range(8))
    args = ["--strategy", TP8, "--model", "qwen2-72b", "--rank-table", table,
            "--ascend-root", str(ascend), "--logs", str(logs),
            "--skip", "software.ascend-backend"]  # no CANN libraries on this machine
    code, checks = doctor_json(capsys, *args)  # --hardware detected from the 310P3 chips
    assert code == 0, checks
    # every check passes but the plan's one warning: bf16 weights computed in float16
    assert {c["status"] for n, c in checks.items() if n != "model.plan"} == {"pass", "skip"}
    plan = checks["model.plan"]
    assert plan["status"] == "warn"
    assert "FITS" in plan["detail"] and "largest value is 65504" in plan["detail"]
    assert "npu-smi 25.2.0: 8 chips (310P3) on 4 cards, devices 0, 1, 2, 3, 4, 5, 6, 7" in \
        checks["devices.npu-smi"]["detail"]
    assert "the strategy needs 8" in checks["devices.count"]["detail"]
    assert "NPU driver 24.1.rc1" in checks["software.driver"]["detail"]
    assert "firmware 7.1.0.11.220" in checks["software.firmware"]["detail"]
    assert "CANN 8.0.RC3" in checks["software.cann"]["detail"]
    assert "computes in float16: the checkpoint is bfloat16" in plan["detail"]
    assert "8 ranks on 1 server(s)" in checks["launch.rank-table"]["detail"]
    assert checks["logs"]["status"] == "pass"
    main(["doctor", *args])
    text = capsys.readouterr().out
    assert text.startswith("msinfer doctor: Atlas 300I Duo (96 GB card, 2 x 310P chips)")
    assert text.rstrip().endswith("0 failed, 1 warning, 14 passed, 1 skipped")


def test_an_unhealthy_chip_fails_naming_its_card_and_chip(box, capsys):
    ascend = box("duo_unhealthy_chip.txt")
    code, checks = doctor_json(capsys, "--ascend-root", str(ascend))
    assert code == 1
    health = checks["devices.health"]
    assert health["status"] == "fail"
    assert health["detail"].startswith("NPU 3 chip 1 (device 5) health Alarm")
    assert "npu-smi info -t health -i 3 -c 1" in health["detail"]


def test_a_missing_chip_fails_the_count_and_the_rank_table(box, tmp_path, capsys):
    ascend = box("duo_missing_chip.txt")
    table = rank_table(tmp_path, range(8))
    code, checks = doctor_json(capsys, "--strategy", TP8, "--rank-table", table,
                               "--ascend-root", str(ascend))
    assert code == 1
    count = checks["devices.count"]
    assert count["status"] == "fail"
    assert "NPU 4 shows 1 chip (chip 0 as device 6) but each Atlas 300I Duo card has 2" in \
        count["detail"]
    assert "needs 8 devices but npu-smi shows 7" in count["detail"]
    assert checks["launch.rank-table"]["status"] == "fail"
    assert "device 7 is not a chip npu-smi shows" in checks["launch.rank-table"]["detail"]


def test_memory_held_by_another_process_warns_with_its_pid(box, capsys):
    ascend = box("duo_busy.txt")
    code, checks = doctor_json(capsys, "--ascend-root", str(ascend),
                               "--skip", "software.ascend-backend")
    assert code == 0  # a warning, not a failure
    memory = checks["devices.memory"]
    assert memory["status"] == "warn"
    assert memory["detail"].startswith("pid 731204 (python3) holds 22300 MB on device 2")


def test_npu_smi_missing_or_failing_fails_the_device_check(box, tmp_path, capsys, monkeypatch):
    ascend = box("duo_4cards.txt")
    code, checks = doctor_json(capsys, "--hardware", "atlas-300i-duo", "--ascend-root",
                               str(ascend))
    assert checks["devices.npu-smi"]["status"] == "pass"
    (tmp_path / "bin" / "npu-smi").write_text(
        "#!/bin/sh\necho 'dcmi module initialize failed. ret is -8005'\nexit 255\n")
    code, checks = doctor_json(capsys, "--hardware", "atlas-300i-duo", "--ascend-root",
                               str(ascend))
    assert code == 1
    assert checks["devices.npu-smi"]["status"] == "fail"
    assert "exit 255: 'dcmi module initialize failed. ret is -8005'" in \
        checks["devices.npu-smi"]["detail"]
    monkeypatch.setenv("PATH", "/nonexistent")
    code, checks = doctor_json(capsys, "--hardware", "atlas-300i-duo", "--ascend-root",
                               str(ascend))
    assert checks["devices.npu-smi"]["detail"].startswith("npu-smi not found on PATH")


def test_version_files_missing_or_cann_not_sourced(box, capsys, monkeypatch):
    ascend = box("duo_4cards.txt")
    os.remove(ascend / "driver" / "version.info")
    os.remove(ascend / "firmware" / "version.info")
    monkeypatch.delenv("ASCEND_HOME_PATH")
    code, checks = doctor_json(capsys, "--ascend-root", str(ascend))
    assert code == 1
    assert checks["software.driver"]["status"] == "fail"
    assert checks["software.firmware"]["status"] == "warn"
    cann = checks["software.cann"]
    assert cann["status"] == "warn"  # installed, but set_env.sh was not sourced
    assert "CANN 8.0.RC3" in cann["detail"] and "ASCEND_HOME_PATH is not set" in cann["detail"]


@pytest.mark.skipif(os.path.exists("/usr/local/Ascend/ascend-toolkit"),
                    reason="CANN is installed here")
def test_mindspore_ascend_backend_fails_without_cann_libraries(box, capsys):
    ascend = box("duo_4cards.txt")
    _, checks = doctor_json(capsys, "--ascend-root", str(ascend))
    backend = checks["software.ascend-backend"]
    assert backend["status"] == "fail"
    assert "libge_runner.so" in backend["detail"] and "set_env.sh" in backend["detail"]


def test_conflicting_environments_are_named(box, tmp_path, capsys, monkeypatch):
    ascend = box("duo_4cards.txt")
    common = ["--strategy", TP8, "--ascend-root", str(ascend)]
    monkeypatch.setenv("RANK_TABLE_FILE", rank_table(tmp_path, range(8)))
    _, checks = doctor_json(capsys, *common)
    env = checks["launch.environment"]
    assert env["status"] == "warn" and "RANK_TABLE_FILE=" in env["detail"]
    assert checks["launch.rank-table"]["status"] == "pass"  # the exported table is checked
    monkeypatch.setenv("RANK_TABLE_FILE", str(tmp_path / "gone.json"))
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    code, checks = doctor_json(capsys, *common)
    assert code == 1
    detail = checks["launch.environment"]["detail"]
    assert checks["launch.environment"]["status"] == "fail"
    assert "(the file does not exist)" in detail
    assert "gone.json: No such file" in checks["launch.rank-table"]["detail"]
    assert "MS_ROLE set in this shell" in detail
    assert "ASCEND_RT_VISIBLE_DEVICES=0,1 shows 2 devices but the strategy needs 8" in detail


def test_a_multi_server_table_is_refused_on_300i_duo(box, tmp_path, capsys):
    ascend = box("duo_4cards.txt")
    table = rank_table(tmp_path, range(8), servers=("10.0.0.1", "10.0.0.2"))
    _, checks = doctor_json(capsys, "--rank-table", table, "--ascend-root", str(ascend))
    assert checks["launch.rank-table"]["status"] == "fail"
    assert "spans 2 servers" in checks["launch.rank-table"]["detail"]


def test_logs_with_each_failure_signature_are_explained(box, tmp_path, capsys):
    logs = tmp_path / "ascend" / "log" / "debug" / "plog"
    logs.mkdir(parents=True)
    (logs / "plog-3132_20251015.log").write_text("[INFO] start\n" + SDMA_LINE + "\n")
    (logs / "plog-1292363_20250408.log").write_text(HCCL_LINE + "\n")
    (logs / "device-553.log").write_text("ok\nok\n" + OOM_LINE + "\n")
    code, checks = doctor_json(capsys, "--hardware", "cpu", "--logs", str(tmp_path / "ascend"))
    assert code == 1
    sdma, hccl, oom = (checks[f"logs.{n}"] for n in ("sdma-copy", "hccl-timeout",
                                                     "out-of-memory"))
    assert all(c["status"] == "fail" for c in (sdma, hccl, oom))
    assert "plog-3132_20251015.log:2" in sdma["detail"] and "no P2P copy" in sdma["detail"]
    assert "plog-1292363_20250408.log:1" in hccl["detail"]
    assert "HCCL_CONNECT_TIMEOUT" in hccl["detail"]
    assert "device-553.log:3" in oom["detail"] and "msinfer plan" in oom["detail"]


def test_a_plan_that_cannot_split_the_model_fails_the_model_check(box, tmp_path, capsys,
                                                                  monkeypatch):
    ascend = box("duo_4cards.txt")
    code, checks = doctor_json(capsys, "--strategy", TP8, "--model", "qwen2-7b",
                               "--ascend-root", str(ascend))
    assert code == 1
    assert checks["model.plan"]["status"] == "fail"
    assert "28 attention heads do not split into 8" in checks["model.plan"]["detail"]
    _, checks = doctor_json(capsys, "--strategy", TP4, "--model", "qwen2-7b",
                            "--ascend-root", str(ascend))
    assert checks["model.plan"]["status"] == "warn"  # fits; bf16 weights in float16
    assert checks["model.plan"]["detail"].startswith("FITS: qwen2-7b")
    assert checks["model.host-memory"]["status"] == "pass"
    (tmp_path / "meminfo").write_text("MemAvailable:    8388608 kB\n")  # 8 GiB
    _, checks = doctor_json(capsys, "--strategy", TP4, "--model", "qwen2-7b",
                            "--ascend-root", str(ascend))
    memory = checks["model.host-memory"]
    assert memory["status"] == "fail"
    assert "loading needs about 14.2 GiB" in memory["detail"] and "8.0 GiB" in memory["detail"]


def test_bad_input_is_a_one_line_error(capsys, tmp_path):
    assert main(["doctor", "--logs", str(tmp_path / "nowhere")]) == 2
    assert "--logs" in capsys.readouterr().err
    assert main(["doctor", "--strategy", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read strategy file" in capsys.readouterr().err


def test_npu_smi_of_a_910b_box_numbers_devices_in_order():
    # The A2 layout: no Device column, HBM-Usage after Memory-Usage (vllm-ascend#1767).
    with open(os.path.join(FIXTURES, "a2_2chips.txt")) as f:
        text = f.read()
    smi = parse_npu_smi(text)
    assert smi.version == "24.1.0.3"
    assert [(c.npu, c.chip, c.device, c.health) for c in smi.chips] == [
        (0, 0, 0, "OK"), (1, 0, 1, "Warning")]
    assert (smi.chips[0].memory_used_mb, smi.chips[0].memory_total_mb) == (3397, 65536)
    assert doctor.detect_hardware(smi) == "atlas-800i-a2"
    with pytest.raises(MsinferError, match="no chip table"):
        parse_npu_smi("dcmi module initialize failed. ret is -8005\n")


def test_multi_server_device_ips_are_checked_against_hccn_conf(box, tmp_path, capsys,
                                                               monkeypatch):
    # An A2 profile, where collectives cross servers: this host's devices must have the
    # device IPs the table gives them.
    ascend = box("duo_4cards.txt")
    monkeypatch.setattr("msinfer.parallel.ranktable.host_ip", lambda: "10.0.0.2")
    table = rank_table(tmp_path, range(8), servers=("10.0.0.1", "10.0.0.2"))
    hccn = tmp_path / "hccn.conf"
    common = ["--hardware", "atlas-800i-a2", "--rank-table", table, "--ascend-root", str(ascend),
              "--hccn-conf", str(hccn)]
    _, checks = doctor_json(capsys, *common)
    assert checks["launch.rank-table"]["status"] == "warn"
    assert f"no {hccn}" in checks["launch.rank-table"]["detail"]
    hccn.write_text("".join(f"address_{d}=192.168.1.{d}\nnetmask_{d}=255.255.255.0\n"
                            for d in range(8)))
    _, checks = doctor_json(capsys, *common)
    assert checks["launch.rank-table"]["status"] == "pass"
    assert "16 ranks on 2 server(s)" in checks["launch.rank-table"]["detail"]
    hccn.write_text(hccn.read_text().replace("address_3=192.168.1.3", "address_3=192.168.9.3"))
    _, checks = doctor_json(capsys, *common)
    assert checks["launch.rank-table"]["status"] == "fail"
    assert checks["launch.rank-table"]["detail"].startswith(
        f"device 3: table 192.168.1.3, {hccn} 192.168.9.3")
