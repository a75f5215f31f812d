"""shmlimit doctor: each check against machines made to order (paths, environment, file-system stats)."""

import functools
import json
import os
import subprocess
import sys

import pytest
from support.segments import captured

import shmlimit
from shmlimit.cli import doctor
from shmlimit.header import KINDS_BY_MAGIC
from shmlimit.shm import layout as L
from shmlimit.shm.cells import native_available

# run once in CI: checks of machines made to order; the backend's on an environment it is given
pytestmark = pytest.mark.backend_independent

MiB = 1 << 20


def fake_statvfs(total, free, frsize=4096):
    def statvfs(path):
        return os.statvfs_result(
            (
                frsize,
                frsize,
                total // frsize,
                free // frsize,
                free // frsize,
                1000,
                1000,
                1000,
                0,
                255,
            )
        )

    return statvfs


def sparse_segment(path, data, size=None):
    """A limiter's segment at ``path``: the header of ``data`` (a real segment's bytes), the rest
    of its ``size`` bytes (its own by default) sparse, as a segment not yet touched."""
    kind = KINDS_BY_MAGIC[int.from_bytes(data[:8], "little")]
    with open(path, "wb") as f:
        f.write(data[: kind.header_bytes])
        f.truncate(len(data) if size is None else size)


@functools.lru_cache(maxsize=None)
def plain_segment():
    return captured(lambda n: shmlimit.Limiter(n, rate=1, slots=L.DEFAULT_SLOTS))


def levels(findings, topic):
    return [f.level for f in findings if f.topic == topic]


def test_backend_says_which_and_why(monkeypatch):
    f = doctor.check_backend({"SHMLIMIT_BACKEND": "atomics"})
    assert f[0].level == "ok" and "forced by SHMLIMIT_BACKEND=atomics" in f[0].message
    assert any("called directly" in x.message for x in f)
    assert doctor.check_backend({"SHMLIMIT_BACKEND": "bogus"})[0].level == "fail"
    if native_available():
        f = doctor.check_backend({})
        assert f == [doctor.Finding("ok", "backend", f[0].message)] and f[0].message.startswith(
            "native"
        )


def test_a_missing_extension_is_a_warning_that_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "shmlimit.shm._native", None
    )  # import fails, as without a compiler
    f = doctor.check_backend({})
    assert f[0].level == "warn" and f[0].message.startswith("atomics:")
    assert "without a C compiler" in f[0].message and "wheel" in f[0].message
    f = doctor.check_backend({"SHMLIMIT_BACKEND": "native"})
    assert f[0].level == "fail" and "ImportError" in f[0].message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm is Linux's")
class TestShm:
    def test_plenty_of_room_is_ok(self, tmp_path):
        f = doctor.check_shm(
            str(tmp_path), {str(tmp_path): "tmpfs"}, fake_statvfs(1024 * MiB, 1000 * MiB), False
        )
        assert levels(f, "/dev/shm") == ["ok"] and "1000.0 MiB free of 1024.0 MiB" in f[0].message

    def test_docker_default_size_is_a_warning(self, tmp_path):
        f = doctor.check_shm(
            str(tmp_path), {str(tmp_path): "tmpfs"}, fake_statvfs(64 * MiB, 60 * MiB), True
        )
        assert levels(f, "/dev/shm") == ["ok", "warn"]
        assert "64 MiB, Docker's default" in f[1].message and "--shm-size" in f[1].message
        assert "container" in f[1].message

    def test_less_room_than_more_limiters_need_is_a_warning(self, tmp_path):
        need = doctor.SPARE_LIMITERS * L.segment_size(L.DEFAULT_SLOTS)
        f = doctor.check_shm(
            str(tmp_path), {str(tmp_path): "tmpfs"}, fake_statvfs(1024 * MiB, need - 4096), False
        )
        assert levels(f, "/dev/shm") == ["warn"] and "more limiters" in f[0].message

    def test_less_room_than_the_present_limiters_may_claim_fails(self, tmp_path):
        for i in range(3):  # sparse segments: their pages are not allocated yet
            sparse_segment(tmp_path / f"shmlimit.seg{i}", plain_segment())
        (tmp_path / "other-program").write_bytes(b"x" * 100)  # not ours: not counted
        count, unbacked = doctor.segments_need(str(tmp_path))
        assert count == 3 and unbacked >= 3 * (L.segment_size(L.DEFAULT_SLOTS) - 4096)
        f = doctor.check_shm(
            str(tmp_path), {str(tmp_path): "tmpfs"}, fake_statvfs(1024 * MiB, unbacked - 1), False
        )
        assert (
            levels(f, "/dev/shm") == ["fail"]
            and "SIGBUS" in f[0].message
            and "3 limiter(s)" in f[0].message
        )

    def test_only_limiters_claim_room_and_no_more_than_they_declare(self, tmp_path):
        """A file named like a segment that no limiter could be (of no kind, or larger than any of
        its kind: every opener refuses it) claims nothing; a limiter's file longer than its header
        declares claims the declared size (no page past it is ever touched)."""
        made = {
            "plain": plain_segment(),
            "keyed": captured(lambda n: shmlimit.KeyedLimiter(n, rate=1, keys=64)),
            "group": captured(lambda n: shmlimit.Limiter(n, rates="a=1/s; b=2/s")),
        }
        for kind, data in made.items():
            sparse_segment(tmp_path / f"shmlimit.{kind}", data)
        sparse_segment(tmp_path / "shmlimit.group-longer", made["group"], 100 << 30)
        sparse_segment(tmp_path / "shmlimit.plain-too-large", made["plain"], 100 << 30)
        with open(tmp_path / "shmlimit.not-a-limiter", "wb") as f:
            f.truncate(100 << 30)
        claims = [
            len(made[kind]) - os.stat(tmp_path / f"shmlimit.{name}").st_blocks * 512
            for kind, name in [(k, k) for k in made] + [("group", "group-longer")]
        ]
        assert doctor.segments_need(str(tmp_path)) == (4, sum(claims))
        f = doctor.check_shm(
            str(tmp_path), {str(tmp_path): "tmpfs"}, fake_statvfs(1024 * MiB, 1000 * MiB), False
        )
        assert levels(f, "/dev/shm") == ["ok"] and "4 limiter(s) present" in f[0].message

    def test_missing_unmounted_or_not_tmpfs(self, tmp_path):
        f = doctor.check_shm(
            str(tmp_path / "nope"), {}, fake_statvfs(1024 * MiB, 1000 * MiB), False
        )
        assert levels(f, "/dev/shm") == ["fail"] and "does not exist" in f[0].message
        f = doctor.check_shm(str(tmp_path), {}, fake_statvfs(1024 * MiB, 1000 * MiB), False)
        assert levels(f, "/dev/shm")[0] == "warn" and "not a mount point" in f[0].message
        f = doctor.check_shm(
            str(tmp_path), {str(tmp_path): "ext4"}, fake_statvfs(1024 * MiB, 1000 * MiB), False
        )
        assert levels(f, "/dev/shm")[0] == "warn" and "not a tmpfs" in f[0].message

    @pytest.mark.skipif(os.getuid() == 0, reason="root may write anywhere")
    def test_unwritable_fails(self, tmp_path):
        tmp_path.chmod(0o500)
        try:
            f = doctor.check_shm(
                str(tmp_path), {str(tmp_path): "tmpfs"}, fake_statvfs(1024 * MiB, 1000 * MiB), False
            )
            assert "fail" in levels(f, "/dev/shm")
        finally:
            tmp_path.chmod(0o700)


def test_machine_checks(tmp_path):
    src = tmp_path / "clocksource"
    slack = tmp_path / "slack"
    src.write_text("hpet\n")
    slack.write_text("50000\n")
    f = doctor.check_machine(str(src), 1, str(slack))
    assert (
        levels(f, "clock") == ["warn"]
        and levels(f, "cpu") == ["warn"]
        and levels(f, "timers") == ["ok"]
    )
    src.write_text("tsc\n")
    slack.write_text("5000000\n")
    f = doctor.check_machine(str(src), 2, str(slack))
    assert (
        levels(f, "clock") == ["ok"] and levels(f, "cpu") == [] and levels(f, "timers") == ["warn"]
    )


def test_stale_limiters_are_pointed_out(name):
    import shmlimit

    lim = shmlimit.Limiter(name, rate=10)
    f = [x for x in doctor.check_segments() if name in x.message]
    assert f == []  # in use by this process
    lim.close()  # detached: no live process uses it now
    f = [x for x in doctor.check_segments() if name in x.message or "shmlimit gc" in x.message]
    assert f and f[0].level == "warn" and "shmlimit gc" in f[0].message


def test_cli_doctor_prints_and_exits_by_the_worst_finding():
    r = subprocess.run(
        [sys.executable, "-m", "shmlimit.cli.main", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = json.loads(r.stdout)
    assert {x["level"] for x in found} <= {"ok", "warn", "fail"}
    assert any(x["topic"] == "backend" for x in found) and any(
        x["topic"] == "/dev/shm" for x in found
    )
    assert r.returncode == (1 if any(x["level"] == "fail" for x in found) else 0)
    r = subprocess.run(
        [sys.executable, "-m", "shmlimit.cli.main", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "backend" in r.stdout and "/dev/shm" in r.stdout
