"""Bucket.mask: the masks beyond causal a record was tuned for (window, softcap, block-sparse);
"" for the dense buckets every earlier row holds.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tuned_records", sa.Column("mask", sa.String(64), nullable=False,
                                             server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("mask")
