"""shardgrid/common/auth.py: bearer parsing and secret files."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shardgrid.common.auth import SecretFileError, bearer_ok, bearer_token, check_bearer, read_secret, write_secret
from shardgrid.cli import main as cli_main
from shardgrid.common.wire import ApiError

MALFORMED = ["", "Bearer", "Bearer ", "Basic dG9r", "tok", "Bearer  tok", " Bearer tok", "Bearer tok ",
             "Bearer \udcff\udcfe", "Bearer t\udcffok", "Token tok"]


@pytest.mark.parametrize("header", MALFORMED)
def test_a_malformed_header_is_unauthorized_never_a_crash(header: str) -> None:
    with pytest.raises(ApiError) as err:
        check_bearer(header, "tok")
    assert err.value.code == "unauthorized"
    assert bearer_ok(header, "tok") is False


def test_the_right_token_passes_and_the_scheme_is_case_insensitive() -> None:
    check_bearer("Bearer tok", "tok")
    check_bearer("bearer tok", "tok")
    check_bearer("Bearer t\u00e9k", "t\u00e9k")  # UTF-8 text is fine
    assert bearer_token(None) is None and bearer_token("Bearer a b") == "a b"
    for wrong in (None, "Bearer to", "Bearer tokk", "Bearer TOK"):
        assert bearer_ok(wrong, "tok") is False
    # No token configured: nothing is checked, not even the header's shape.
    check_bearer("Bearer \udcff", None)
    check_bearer(None, None)


def test_read_secret_refuses_a_file_others_can_read(tmp_path: Path) -> None:
    path = tmp_path / "cluster.secret"
    path.write_text("s3cret\n")
    for mode in (0o644, 0o640, 0o604, 0o620):
        path.chmod(mode)
        with pytest.raises(SecretFileError) as err:
            read_secret(str(path), "NOPE_NOT_SET")
        assert f"chmod 600 {path}" in str(err.value) and "s3cret" not in str(err.value)
    path.chmod(0o600)
    assert read_secret(str(path), "NOPE_NOT_SET") == "s3cret"
    path.chmod(0o400)
    assert read_secret(str(path), "NOPE_NOT_SET") == "s3cret"


def test_write_secret_creates_0600_and_replaces_atomically(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # the mode must not depend on the caller's umask
    try:
        path = tmp_path / "sub" / "admin.token"
        write_secret(path, "first")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "first\n"
        write_secret(path, "second")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_secret(str(path), "X") == "second"
        assert sorted(p.name for p in path.parent.iterdir()) == ["admin.token"]  # no temporary left
    finally:
        os.umask(old_umask)


def test_meta_with_a_group_readable_secret_exits_2_with_the_fix(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cluster.secret"
    path.write_text("s3cret\n")
    path.chmod(0o644)
    code = cli_main(["meta", "--id", "m1", "--raft", "127.0.0.1:1", "--http", "127.0.0.1:2",
                     "--data", str(tmp_path / "d"), "--secret-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and f"chmod 600 {path}" in err and "s3cret" not in err


def test_dev_creates_its_secret_0600_and_tightens_one_an_older_version_left(tmp_path: Path) -> None:
    from shardgrid.devcluster import ensure_secret

    fresh = ensure_secret(tmp_path / "dev" / "cluster.secret")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600 and read_secret(str(fresh), "X")
    value = fresh.read_text()
    fresh.chmod(0o644)
    assert ensure_secret(fresh) == fresh and stat.S_IMODE(fresh.stat().st_mode) == 0o600
    assert fresh.read_text() == value  # kept: meta nodes already run with it


@pytest.mark.parametrize("who", ["meta", "worker", "gateway"])
def test_a_short_cluster_secret_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], who: str) -> None:
    path = tmp_path / "cluster.secret"
    write_secret(path, "short\nand-a-long-enough-second-line")
    args = {"meta": ["meta", "--id", "m1", "--raft", "127.0.0.1:1", "--http", "127.0.0.1:2", "--data", str(tmp_path)],
            "worker": ["worker", "--id", "w1", "--http", "127.0.0.1:1", "--meta", "127.0.0.1:2", "--data",
                       str(tmp_path)],
            "gateway": ["gateway", "--http", "127.0.0.1:1", "--meta", "127.0.0.1:2"]}[who]
    assert cli_main([*args, "--secret-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "at least 16 characters" in err and "short" not in err.replace("shardgrid", "")


def test_a_gateway_id_that_is_no_principal_name_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cluster.secret"
    write_secret(path, "a-cluster-secret-of-some-length")
    assert cli_main(["gateway", "--http", "[::]:8080", "--meta", "127.0.0.1:2", "--secret-file", str(path),
                     "--id", "g 1"]) == 2
    assert "--id 'g 1'" in capsys.readouterr().err
