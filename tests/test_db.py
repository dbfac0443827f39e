"""The tuned DB on SQLite and PostgreSQL: round trip, migrations, concurrent writers, bad input.

PostgreSQL cases need FLASHTUNE_TEST_POSTGRES (set by .ci/run); each runs in its own schema.
"""
import dataclasses
import multiprocessing as mp
import os
import uuid

import pytest
import sqlalchemy as sa

from flashtune.codegen import Variant, kernel_hash
from flashtune.problem import Bucket
from flashtune.tuned_db import DBError, Provenance, Record, TunedDB

PG_URL = os.environ.get("FLASHTUNE_TEST_POSTGRES")
H100 = "nvidia-h100-80gb-hbm3"


def _triton_version():
    import triton
    return triton.__version__


def make_record(gpu=H100, sq=1024, sk=None, bh=16, variant="fwd-m128-n64-w4-s3", ms=1.0,
                source="search", triton=None, thash=None, d=128, causal=True, dtype="float16",
                gqa=False, family="fwd") -> Record:
    """A record with plausible fields (tests only: these numbers were never measured)."""
    bucket = Bucket(family, dtype, d, causal, gqa, sq, sk or sq, bh)
    v = Variant.parse(variant)
    prov = Provenance("NVIDIA H100 80GB HBM3", "9.0", 132, "550.54", "12.4", "2.13.0",
                      triton or _triton_version(), "0.1.0",
                      kernel_hash(v) if thash is None else thash,
                      "2025-11-21T00:00:00+00:00", source)
    return Record(gpu, bucket, v, ms, 123.456 / ms, "TFLOP/s", 1.5e-3, prov,
                  (("fwd-m64-n64-w4-s3", ms * 1.1), ("fwd-m128-n32-w8-s2", ms * 1.25)))


def _pg_schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    """A fresh, empty database: a SQLite file, or a new schema on the PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tuned.db'}"
        return
    if not PG_URL:
        pytest.skip("FLASHTUNE_TEST_POSTGRES is not set (.ci/run starts PostgreSQL and sets it)")
    schema = f"ft_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL)
    with admin.begin() as c:
        c.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield _pg_schema_url(PG_URL, schema)
    finally:
        with admin.begin() as c:
            c.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def test_round_trip(db_url):
    db = TunedDB(db_url)
    recs = [make_record(sq=n, bh=bh) for n in (512, 1024, 4096) for bh in (8, 16)]
    recs.append(make_record(gqa=True, causal=False, variant="fwd-m64-n32-w4-s2-loads=descriptor"))
    for r in recs:
        db.put(r)
    assert sorted(db.records(), key=lambda r: r.key) == sorted(recs, key=lambda r: r.key)
    for r in recs:
        got = db.get(r.gpu, r.bucket)
        assert got == r and got.key == r.key  # every field, floats and runner-ups exactly
    assert db.get("H100", recs[0].bucket) == recs[0]  # short names resolve to the slug
    assert db.get("nvidia-h200", recs[0].bucket) is None
    assert db.records(gpu="nvidia-h200") == [] and db.records(family="bwd") == []
    db.dispose()


def test_put_upserts_on_natural_key(db_url):
    db = TunedDB(db_url)
    db.put(make_record(ms=2.0))
    newer = make_record(ms=1.0, variant="fwd-m64-n64-w4-s2")
    db.put(newer)
    assert db.records() == [newer]
    assert db.delete(H100, newer.bucket) and db.records() == []


def test_migrations_from_an_empty_db(db_url):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from flashtune.tuned_db import migrate
    from flashtune.tuned_db.models import Base

    db = TunedDB(db_url)
    assert db.records() == []  # first use creates the schema
    engine = sa.create_engine(db_url)
    with engine.connect() as c:
        assert migrate.current(c) == migrate.head() == "0002"
        # the models and what the migrations built agree: no pending autogenerate diff
        assert compare_metadata(MigrationContext.configure(c), Base.metadata) == []
    # a second open is a no-op and keeps the data
    db.put(make_record())
    assert len(TunedDB(db_url).records()) == 1
    engine.dispose()


def test_alembic_downgrade_and_upgrade_by_hand(db_url):
    from alembic import command

    from flashtune.tuned_db import migrate
    TunedDB(db_url).records()
    engine = sa.create_engine(db_url)
    with engine.begin() as c:
        cfg = migrate._config()
        cfg.attributes["connection"] = c
        command.downgrade(cfg, "base")
    assert "tuned_records" not in sa.inspect(engine).get_table_names()
    db = TunedDB(db_url)
    db.put(make_record())
    assert len(db.records()) == 1
    engine.dispose()


def test_unknown_schema_revision_is_a_clear_error(db_url):
    TunedDB(db_url).records()
    engine = sa.create_engine(db_url)
    with engine.begin() as c:
        c.execute(sa.text("UPDATE alembic_version SET version_num = '9999_future'"))
    engine.dispose()
    with pytest.raises(DBError, match="9999_future.*does not know"):
        TunedDB(db_url).records()


def test_row_with_a_variant_the_generator_no_longer_knows(db_url):
    db = TunedDB(db_url)
    db.put(make_record(sq=512))
    db.put(make_record(sq=2048))
    engine = sa.create_engine(db_url)
    with engine.begin() as c:
        c.execute(sa.text("UPDATE tuned_records SET variant = :v WHERE seqlen_q = 512"),
                  {"v": '{"family": "fwd", "block_m": 128, "block_n": 64, "num_warps": 4, '
                        '"num_stages": 3, "swizzle": 8}'})
    engine.dispose()
    with pytest.raises(DBError, match=r"tuned DB .*row .*swizzle"):
        db.records()
    assert [r.bucket.seqlen_q for r in db.records(strict=False)] == [2048]


def test_unreachable_url_names_the_url_and_hides_the_password():
    url = "postgresql+psycopg://someone:hunter2@127.0.0.1:1/nowhere"
    with pytest.raises(DBError) as e:
        TunedDB(url).records()
    assert "127.0.0.1:1/nowhere" in str(e.value) and "hunter2" not in str(e.value)


@pytest.mark.parametrize("url", ["notaurl", "nosuchdialect://x/y"])
def test_bad_url_is_a_clear_error(url):
    with pytest.raises(DBError, match="cannot open tuned DB"):
        TunedDB(url).records()


def test_unwritable_sqlite_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DBError, match="file"):
        TunedDB(f"sqlite:///{blocker}/sub/tuned.db").records()


def test_default_location_and_laziness(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    db = TunedDB()
    assert db.url == f"sqlite:///{tmp_path / 'cache' / 'tuned.db'}"
    assert not (tmp_path / "cache").exists()  # nothing is created before the first use
    db.put(make_record())
    assert (tmp_path / "cache" / "tuned.db").exists()
    monkeypatch.setenv("FLASHTUNE_DB", f"sqlite:///{tmp_path / 'other.db'}")
    assert TunedDB().url.endswith("other.db")
    assert TunedDB("sqlite:///x.db").url == "sqlite:///x.db"  # the argument wins


def test_put_rejects_inconsistent_records(tmp_path):
    db = TunedDB(f"sqlite:///{tmp_path / 't.db'}")
    bad = dataclasses.replace(make_record(), provenance=dataclasses.replace(
        make_record().provenance, source="guess"))
    with pytest.raises(ValueError, match="source"):
        db.put(bad)


# -- concurrent writers -----------------------------------------------------------------------
N_PROCS, N_OWN, N_SHARED = 4, 40, 8


def _writer(url: str, worker: int, start) -> None:
    db = TunedDB(url)
    start.wait(60)  # all writers hit the DB at the same moment, not as each finishes importing
    for i in range(N_OWN):  # distinct keys: bh differs per worker, sq per record
        db.put(make_record(sq=1 << (i % 12), sk=1 << (i // 12), bh=1 << (worker + 8)))
        if i % (N_OWN // N_SHARED) == 0:  # keys every worker writes, with its own timing
            db.put(make_record(sq=1 << (i // (N_OWN // N_SHARED)), bh=1, ms=1.0 + worker))
    db.dispose()


def test_concurrent_writers_lose_nothing(db_url):
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(N_PROCS)
    procs = [ctx.Process(target=_writer, args=(db_url, w, start)) for w in range(N_PROCS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * N_PROCS
    recs = TunedDB(db_url).records()
    own = [r for r in recs if r.bucket.batch_heads > 1]
    shared = [r for r in recs if r.bucket.batch_heads == 1]
    assert len(own) == N_PROCS * N_OWN
    assert {(r.bucket.batch_heads, r.bucket.seqlen_q, r.bucket.seqlen_k) for r in own} == {
        (1 << (w + 8), 1 << (i % 12), 1 << (i // 12)) for w in range(N_PROCS) for i in range(N_OWN)}
    assert len(shared) == N_SHARED
    assert all(r.median_ms in {1.0 + w for w in range(N_PROCS)} for r in shared)


def test_a_0001_db_upgrades_to_the_mask_column(tmp_path):
    # a tuned DB made before Bucket.mask: its rows read back as dense buckets
    from alembic import command

    from flashtune.tuned_db import migrate
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        cfg = migrate._config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    db = TunedDB(url)
    assert db.records() == []
    db.put(make_record())
    assert [r.bucket.mask for r in db.records()] == [""]
