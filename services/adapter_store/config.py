"""Settings of the adapter store (every field also settable as VALORA_<FIELD>)."""

from __future__ import annotations

from pydantic import Field

from services.common.config import ServiceSettings


class StoreSettings(ServiceSettings):
    database_url: str = Field(
        "sqlite:///valora-store.db",
        description="SQLAlchemy URL of the metadata database: sqlite:///path.db (embedded) or "
        "postgresql+psycopg://user@host:5432/db.",
    )
    blob_dir: str = Field(
        "valora-blobs", description="Directory of the local blob store (used when s3_endpoint is empty)."
    )
    s3_endpoint: str = Field("", description="host:port of an S3/MinIO endpoint; empty selects blob_dir.")
    s3_bucket: str = Field("valora-adapters", description="Bucket holding the bundles (created if missing).")
    s3_access_key: str = Field("", description="S3 access key.")
    s3_secret_key: str = Field("", description="S3 secret key.")
    s3_secure: bool = Field(False, description="Use HTTPS towards the S3 endpoint.")
    s3_region: str = Field("us-east-1", description="S3 region (MinIO ignores it).")
    s3_part_size: int = Field(
        16 * 1024 * 1024, description="Multipart part size in bytes for bundles larger than one part."
    )
    model_path: str = Field(
        "", description="Local path of the base model; its config.json gives the shapes uploads are checked against."
    )
    base_model: str = Field(
        "", description="Base model id recorded on versions; empty means the name of model_path's directory."
    )
    max_rank: int = Field(128, description="Largest LoRA rank accepted.")
    max_header_bytes: int = Field(1 << 20, description="Largest safetensors header accepted, in bytes.")
    max_bundle_bytes: int = Field(1 << 30, description="Largest bundle accepted, in bytes (enforced while receiving).")
    max_dataset_bytes: int = Field(
        1 << 30, description="Largest dataset archive accepted (AdminService.UploadDataset), in bytes."
    )
    upload_spool_dir: str = Field(
        "", description="Directory uploads are spooled to while they arrive; empty: the system temp dir."
    )
    fetch_chunk_bytes: int = Field(1 << 20, description="Chunk size of FetchAdapter's byte stream.")
    pending_grace_s: float = Field(
        3600.0, description="GC removes PENDING versions and unreferenced blobs older than this many seconds."
    )
    db_connect_timeout_s: float = Field(
        5.0, gt=0, description="PostgreSQL connect timeout (and the longest wait for a pooled connection), seconds."
    )
    db_statement_timeout_s: float = Field(30.0, gt=0, description="PostgreSQL statement_timeout, seconds.")
    s3_connect_timeout_s: float = Field(5.0, gt=0, description="S3 connect timeout, seconds.")
    s3_read_timeout_s: float = Field(60.0, gt=0, description="S3 read timeout (between bytes), seconds.")
    backend_timeout_s: float = Field(
        60.0,
        gt=0,
        description="The longest an RPC waits for the database or the "
        "blob store before it fails UNAVAILABLE (uploads included: keep it above the "
        "largest bundle's write time).",
    )
    health_check_s: float = Field(
        5.0,
        ge=0,
        description="Seconds between checks of the database and the blob "
        "store; health is NOT_SERVING while either fails. 0: not checked.",
    )
    health_check_timeout_s: float = Field(5.0, gt=0, description="A backend check slower than this fails.")
    gc_interval_s: float = Field(600.0, description="Seconds between background GC runs; 0 disables the background GC.")
    job_lease_s: float = Field(
        60.0,
        gt=0,
        description="Generation jobs: how long a runner's claim holds without an update (runners "
        "heartbeat at a third of it); a job whose lease lapses is requeued.",
    )
    job_max_attempts: int = Field(
        3, ge=1, description="Generation jobs: claims a job may lose (lease lapsed) before it ends FAILED."
    )
    job_sweep_interval_s: float = Field(
        10.0,
        ge=0,
        description="Seconds between requeue sweeps of RUNNING jobs whose lease lapsed (claims "
        "also sweep); 0 disables the timer.",
    )
    db_workers: int = Field(8, description="Threads running blocking database and blob work.")
    run_migrations: bool = Field(True, description="Run `alembic upgrade head` when the server starts.")
