"""Initial schema: tuned_records, one row per (GPU, kernel family, bucket).

Revision ID: 0001
Revises:
Create Date: 2025-11-21
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tuned_records",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("gpu", sa.String(128), nullable=False),
        sa.Column("family", sa.String(32), nullable=False),
        sa.Column("bucket_key", sa.String(64), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("causal", sa.Boolean(), nullable=False),
        sa.Column("gqa", sa.Boolean(), nullable=False),
        sa.Column("seqlen_q", sa.Integer(), nullable=False),
        sa.Column("seqlen_k", sa.Integer(), nullable=False),
        sa.Column("batch_heads", sa.Integer(), nullable=False),
        sa.Column("variant", sa.Text(), nullable=False),
        sa.Column("variant_name", sa.String(255), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=False),
        sa.Column("throughput", sa.Float(), nullable=False),
        sa.Column("unit", sa.String(16), nullable=False),
        sa.Column("max_err", sa.Float(), nullable=False),
        sa.Column("runner_ups", sa.Text(), nullable=False),
        sa.Column("gpu_name", sa.String(255), nullable=False),
        sa.Column("compute_capability", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("driver", sa.String(64), nullable=False),
        sa.Column("cuda", sa.String(64), nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("flashtune_version", sa.String(64), nullable=False),
        sa.Column("template_hash", sa.String(64), nullable=False),
        sa.Column("found_at", sa.String(40), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.UniqueConstraint("gpu", "family", "bucket_key", name="uq_tuned_records_natural"),
    )
    op.create_index("ix_tuned_records_gpu_family", "tuned_records", ["gpu", "family"])


def downgrade() -> None:
    op.drop_index("ix_tuned_records_gpu_family", table_name="tuned_records")
    op.drop_table("tuned_records")
