"""Which storage errors the adapter store reports as an outage (UNAVAILABLE, retry) and which
as a bug (INTERNAL)."""

import psycopg
from sqlalchemy import exc as sa_exc

from services.adapter_store.servicer import _backend_down


def _wrapped(make_orig) -> sa_exc.DBAPIError:
    try:
        make_orig()
    except psycopg.Error as orig:
        return sa_exc.DBAPIError.instance("SELECT 1", {}, orig, psycopg.Error)
    raise AssertionError("make_orig did not raise")


def _ping_over_a_cut_link():
    # SQLAlchemy's psycopg do_ping: the execute fails with the link, then restoring autocommit in
    # its `finally` raises over it (the connection was left mid-command)
    try:
        raise psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly")
    finally:
        raise psycopg.ProgrammingError("can't change 'autocommit' now: connection in transaction status ACTIVE")


def _bad_sql():
    raise psycopg.ProgrammingError('syntax error at or near "SELEC"')


def _refused():
    raise psycopg.OperationalError("connection refused")


def test_a_lost_connection_masked_by_the_ping_is_an_outage():
    exc = _wrapped(_ping_over_a_cut_link)
    assert isinstance(exc, sa_exc.ProgrammingError) and not exc.connection_invalidated
    assert _backend_down(exc)


def test_a_bad_query_is_not_an_outage():
    exc = _wrapped(_bad_sql)
    assert isinstance(exc, sa_exc.ProgrammingError)
    assert not _backend_down(exc)
    assert _backend_down(_wrapped(_refused))
