"""SQLAlchemy models of the tuned DB: one row per (GPU, kernel family, bucket).

The schema is owned by the alembic migrations in migrations/versions/; these models must stay
equal to what the migrations build (tests/test_db.py compares them).
"""
from __future__ import annotations

from sqlalchemy import Boolean, Float, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

TABLE = "tuned_records"


class Base(DeclarativeBase):
    pass


class TunedRow(Base):
    __tablename__ = TABLE
    __table_args__ = (
        # the natural key: one winner per GPU, kernel family and bucket
        UniqueConstraint("gpu", "family", "bucket_key", name="uq_tuned_records_natural"),
        Index("ix_tuned_records_gpu_family", "gpu", "family"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    gpu: Mapped[str] = mapped_column(String(128))
    family: Mapped[str] = mapped_column(String(32))
    bucket_key: Mapped[str] = mapped_column(String(64))  # Bucket.key (sha256 of its sorted JSON)
    # the bucket's fields, as columns so that the rows read (and filter) without decoding
    dtype: Mapped[str] = mapped_column(String(16))
    head_dim: Mapped[int] = mapped_column(Integer)
    causal: Mapped[bool] = mapped_column(Boolean)
    gqa: Mapped[bool] = mapped_column(Boolean)
    seqlen_q: Mapped[int] = mapped_column(Integer)
    seqlen_k: Mapped[int] = mapped_column(Integer)
    batch_heads: Mapped[int] = mapped_column(Integer)
    mask: Mapped[str] = mapped_column(String(64), server_default="")  # Bucket.mask ("" dense)
    # the winner: Variant.to_json() (sorted, every field) and its name for people
    variant: Mapped[str] = mapped_column(Text)
    variant_name: Mapped[str] = mapped_column(String(255))
    median_ms: Mapped[float] = mapped_column(Float)
    throughput: Mapped[float] = mapped_column(Float)
    unit: Mapped[str] = mapped_column(String(16))
    max_err: Mapped[float] = mapped_column(Float)
    runner_ups: Mapped[str] = mapped_column(Text)  # JSON [[variant name, median ms], ...]
    # provenance
    gpu_name: Mapped[str] = mapped_column(String(255))
    compute_capability: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    driver: Mapped[str] = mapped_column(String(64))
    cuda: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    triton_version: Mapped[str] = mapped_column(String(64))
    flashtune_version: Mapped[str] = mapped_column(String(64))
    template_hash: Mapped[str] = mapped_column(String(64))
    found_at: Mapped[str] = mapped_column(String(40))  # Provenance.date, ISO 8601 kept verbatim
    source: Mapped[str] = mapped_column(String(16))    # "search" | "import" | "default"
