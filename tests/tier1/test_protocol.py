"""The constants gateway and worker share: call ops and the error-code table."""
from __future__ import annotations



def test_the_worker_answers_exactly_the_call_ops_the_protocol_names() -> None:
    from shardgrid.common.protocol import CALL_OPS
    from worker.server import WorkerApi

    api = WorkerApi(object())  # type: ignore[arg-type]
    assert sorted(api._call_ops) == sorted(CALL_OPS)


def test_one_table_of_error_codes_the_reverse_map_agrees_with_it() -> None:
    from shardgrid.common.wire import CODE_FOR_STATUS, STATUS_FOR_CODE

    assert all(STATUS_FOR_CODE[code] == status for status, code in CODE_FOR_STATUS.items())
