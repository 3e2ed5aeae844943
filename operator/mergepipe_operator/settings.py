"""Operator settings: what the Helm chart configures, read from environment variables.

Every variable is optional except the merger image. The chart's Deployment sets them from
``values.yaml`` (see ``helm/mergepipe/templates/deployment.yaml``); a test renders the chart and
checks that :meth:`Settings.from_env` reads back what the values say.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "MERGEPIPE_"


def _opt(env: Mapping[str, str], name: str) -> str | None:
    v = env.get(ENV_PREFIX + name, "").strip()
    return v or None


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    v = _opt(env, name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {ENV_PREFIX}{name}={v!r} is not an integer") from None


def _json(env: Mapping[str, str], name: str, default: Any) -> Any:
    v = _opt(env, name)
    if v is None:
        return default
    try:
        return json.loads(v)
    except json.JSONDecodeError as e:
        raise ValueError(f"environment variable {ENV_PREFIX}{name} is not valid JSON: {e}") from None


def _bool(env: Mapping[str, str], name: str) -> bool:
    v = (_opt(env, name) or "false").lower()
    if v not in ("true", "false", "1", "0"):
        raise ValueError(f"environment variable {ENV_PREFIX}{name} must be true or false, got {v!r}")
    return v in ("true", "1")


def _bytes_per_part(env: Mapping[str, str], default: int) -> int:
    """``MERGEPIPE_BYTES_PER_PART`` as bytes (a Kubernetes quantity), ``default`` when unset.

    Raises:
        ValueError: not a quantity, or below 1 byte.
    """
    if not _opt(env, "BYTES_PER_PART"):
        return default
    from .quantities import QuantityError, parse_quantity

    try:
        bytes_per_part = parse_quantity(_opt(env, "BYTES_PER_PART"), field=f"{ENV_PREFIX}BYTES_PER_PART")
    except QuantityError as e:
        raise ValueError(str(e)) from None
    if bytes_per_part < 1:
        raise ValueError(f"{ENV_PREFIX}BYTES_PER_PART must be at least 1 byte")
    return bytes_per_part


def _default_budget(env: Mapping[str, str]) -> str | None:
    """``MERGEPIPE_DEFAULT_BUDGET`` as given (the chart's merges.defaultBudget), checked here so a
    bad value is refused at start, not at each merge.

    Raises:
        ValueError: not a quantity, or below 1 byte.
    """
    default_budget = _opt(env, "DEFAULT_BUDGET")
    if default_budget:
        from .quantities import QuantityError, parse_quantity

        try:
            if parse_quantity(default_budget, field=f"{ENV_PREFIX}DEFAULT_BUDGET") < 1:
                raise ValueError(f"{ENV_PREFIX}DEFAULT_BUDGET must be at least 1 byte")
        except QuantityError as e:
            raise ValueError(str(e)) from None
    return default_budget


def _sketches(env: Mapping[str, str]) -> tuple[str | None, dict[Any, Any]]:
    """``(MERGEPIPE_SKETCH, MERGEPIPE_SKETCH_BY_NAMESPACE)``: the default sketch kind and the
    per-namespace kinds (JSON object).

    Raises:
        ValueError: a kind that is not one of ``SKETCH_KINDS``, or a non-object mapping.
    """
    from mergepipe.catalog.sketch import SKETCH_KINDS

    sketch = _opt(env, "SKETCH")
    if sketch is not None and sketch not in SKETCH_KINDS:
        raise ValueError(f"{ENV_PREFIX}SKETCH must be one of {', '.join(SKETCH_KINDS)}, got {sketch!r}")
    by_ns = _json(env, "SKETCH_BY_NAMESPACE", {})
    if not isinstance(by_ns, dict) or any(v not in SKETCH_KINDS for v in by_ns.values()):
        raise ValueError(
            f"{ENV_PREFIX}SKETCH_BY_NAMESPACE must map namespaces to one of {', '.join(SKETCH_KINDS)}, got {by_ns!r}"
        )
    return sketch, by_ns


def _allowed_images(env: Mapping[str, str]) -> list[str]:
    """``MERGEPIPE_ALLOWED_IMAGES``: a JSON list of non-empty image patterns (``[]`` when unset).

    Raises:
        ValueError: not a list of non-empty strings.
    """
    allowed = _json(env, "ALLOWED_IMAGES", [])
    if not isinstance(allowed, list) or not all(isinstance(a, str) and a.strip() for a in allowed):
        raise ValueError(f"{ENV_PREFIX}ALLOWED_IMAGES must be a JSON list of non-empty strings, got {allowed!r}")
    return allowed


@dataclass(frozen=True)
class Settings:
    """Cluster-wide defaults of the operator. A ModelMerge's spec overrides the per-merge ones
    (GPU, CPU, memory, S3 endpoint/region/Secret; the image only when :attr:`allowed_images`
    admits it)."""

    merger_image: str = "ghcr.io/mergepipe/merger:latest"
    image_pull_policy: str = "IfNotPresent"
    # object storage
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_secret_name: str | None = None
    s3_access_key_id_key: str = "AWS_ACCESS_KEY_ID"
    s3_secret_access_key_key: str = "AWS_SECRET_ACCESS_KEY"
    catalog_uri: str | None = None
    plan_prefix: str | None = None
    #: calibration set (s3:// JSON lines) of merges whose spec names none: their plans use the
    #: fisher block value, and the analyze Job records the base's sensitivity on it
    calibration_uri: str | None = None
    #: fidelity tiers (``none``, ``sign1``..``sign3``, ``sign3+r1``) of merges whose spec sets no ``sketch``
    #: (chart ``merges.sketch``); None: the core's default (:data:`mergepipe.catalog.sketch.DEFAULT_SKETCH`)
    sketch: str | None = None
    #: per-namespace fidelity tiers of merges whose spec sets no ``sketch`` (chart
    #: ``merges.sketchByNamespace``), before :attr:`sketch`
    sketch_by_namespace: dict[str, str] = field(default_factory=dict)
    # merges
    default_budget: str | None = None
    gpu_resource_name: str = "nvidia.com/gpu"
    gpu_count: int = 1
    cpu: str | None = "4"
    memory: str | None = "32Gi"
    #: also set limits.cpu = requests.cpu on every worker Job (chart ``merger.resources.limitCPU``)
    limit_cpu: bool = False
    tmp_size_limit: str | None = None
    backoff_limit: int = 2
    active_deadline_seconds: int = 6 * 3600
    ttl_seconds_after_finished: int = 24 * 3600
    job_service_account: str | None = None
    run_as_user: int = 10001
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    # operator behaviour
    watch_namespaces: tuple[str, ...] = ()
    quota_retry_seconds: int = 300
    #: seconds between checks of a running analyze Job (the merge is planned when it finished)
    analyze_poll_seconds: int = 15
    #: partitioned merges (an Indexed Job of N pods, each ``execute --part i/N``): the most pods
    #: one merge may use (chart ``merges.parallelism.max``; bounds ``spec.parallelism`` and the
    #: automatic choice) and the bytes one pod should move (base + expert read + output write)
    #: when the ModelMerge leaves ``spec.parallelism`` unset (``merges.parallelism.bytesPerPart``)
    max_parallelism: int = 8
    bytes_per_part: int = 100 * 1024**3
    metrics_port: int | None = None
    #: address the metrics endpoint binds to (chart ``metrics.bindAddress``)
    metrics_bind_address: str = "0.0.0.0"
    #: images a ModelMerge/MergeSearch ``spec.image`` may name (chart ``merges.allowedImages``:
    #: digest pins or globs, :mod:`mergepipe_operator.k8s.images`); empty: per-merge images are
    #: refused and every worker runs :attr:`merger_image`
    allowed_images: tuple[str, ...] = ()
    # merge searches: the driver Job's ServiceAccount (a Role lets it create ModelMerges and Jobs in
    # its namespace) and its resources (botorch on CPU; the candidates' merge Jobs get the GPUs)
    search_service_account: str = "mergepipe-search-driver"
    search_driver_cpu: str = "2"
    search_driver_memory: str = "8Gi"
    #: Secret (in each search's namespace) with the S3 keys of the evaluation Jobs, which run the
    #: tenant's evaluator command (chart ``search.evaluator.credentialsSecret``): keys that may only
    #: read the candidates' snapshots and write the metrics objects. None: the merge Jobs' Secret.
    eval_s3_secret_name: str | None = None
    #: seconds between reads of a running search's results (status mirroring)
    search_poll_seconds: int = 30
    # Kueue: the LocalQueue of Jobs whose ModelMerge/MergeSearch names none (label
    # kueue.x-k8s.io/queue-name), and whether this operator serves the io-budget AdmissionCheck
    queue_name: str | None = None
    kueue_admission_check: bool = False

    @property
    def default_budget_bytes(self) -> int | None:
        """``default_budget`` in bytes (the one byte grammar,
        :func:`~mergepipe_operator.quantities.parse_quantity`); ``None`` when unset.

        Raises:
            QuantityError: the value is not a byte quantity (:meth:`from_env` refuses it at start).
        """
        from .quantities import parse_quantity

        if not self.default_budget:
            return None
        return parse_quantity(self.default_budget, field=f"{ENV_PREFIX}DEFAULT_BUDGET")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read ``MERGEPIPE_*`` variables (``os.environ`` by default)."""
        env = os.environ if env is None else env
        d = cls()
        gpu_count = _int(env, "GPU_COUNT", d.gpu_count)
        if gpu_count < 0:
            raise ValueError(f"{ENV_PREFIX}GPU_COUNT must be >= 0, got {gpu_count}")
        metrics = _opt(env, "METRICS_PORT")
        max_parallelism = _int(env, "MAX_PARALLELISM", d.max_parallelism)
        if max_parallelism < 1:
            raise ValueError(f"{ENV_PREFIX}MAX_PARALLELISM must be >= 1, got {max_parallelism}")
        bytes_per_part = _bytes_per_part(env, d.bytes_per_part)
        default_budget = _default_budget(env)
        sketch, by_ns = _sketches(env)
        ns = _opt(env, "WATCH_NAMESPACES")
        allowed = _allowed_images(env)
        return cls(
            merger_image=_opt(env, "MERGER_IMAGE") or d.merger_image,
            image_pull_policy=_opt(env, "IMAGE_PULL_POLICY") or d.image_pull_policy,
            s3_endpoint=_opt(env, "S3_ENDPOINT"),
            s3_region=_opt(env, "S3_REGION"),
            s3_secret_name=_opt(env, "S3_SECRET_NAME"),
            s3_access_key_id_key=_opt(env, "S3_ACCESS_KEY_ID_KEY") or d.s3_access_key_id_key,
            s3_secret_access_key_key=_opt(env, "S3_SECRET_ACCESS_KEY_KEY") or d.s3_secret_access_key_key,
            catalog_uri=_opt(env, "CATALOG_URI"),
            plan_prefix=_opt(env, "PLAN_PREFIX"),
            calibration_uri=_opt(env, "CALIBRATION_URI"),
            sketch=sketch,
            sketch_by_namespace={str(k): str(v) for k, v in by_ns.items()},
            default_budget=default_budget,
            gpu_resource_name=_opt(env, "GPU_RESOURCE_NAME") or d.gpu_resource_name,
            gpu_count=gpu_count,
            cpu=_opt(env, "JOB_CPU") or d.cpu,
            memory=_opt(env, "JOB_MEMORY") or d.memory,
            limit_cpu=_bool(env, "JOB_CPU_LIMIT"),
            tmp_size_limit=_opt(env, "JOB_TMP_SIZE_LIMIT"),
            backoff_limit=_int(env, "JOB_BACKOFF_LIMIT", d.backoff_limit),
            active_deadline_seconds=_int(env, "JOB_ACTIVE_DEADLINE_SECONDS", d.active_deadline_seconds),
            ttl_seconds_after_finished=_int(env, "JOB_TTL_SECONDS_AFTER_FINISHED", d.ttl_seconds_after_finished),
            job_service_account=_opt(env, "JOB_SERVICE_ACCOUNT"),
            run_as_user=_int(env, "JOB_RUN_AS_USER", d.run_as_user),
            node_selector=_json(env, "JOB_NODE_SELECTOR", {}),
            tolerations=_json(env, "JOB_TOLERATIONS", []),
            watch_namespaces=tuple(n.strip() for n in ns.split(",") if n.strip()) if ns else (),
            quota_retry_seconds=_int(env, "QUOTA_RETRY_SECONDS", d.quota_retry_seconds),
            analyze_poll_seconds=_int(env, "ANALYZE_POLL_SECONDS", d.analyze_poll_seconds),
            max_parallelism=max_parallelism,
            bytes_per_part=bytes_per_part,
            metrics_port=int(metrics) if metrics else None,
            metrics_bind_address=_opt(env, "METRICS_BIND_ADDRESS") or d.metrics_bind_address,
            allowed_images=tuple(a.strip() for a in allowed),
            search_service_account=_opt(env, "SEARCH_SERVICE_ACCOUNT") or d.search_service_account,
            search_driver_cpu=_opt(env, "SEARCH_DRIVER_CPU") or d.search_driver_cpu,
            search_driver_memory=_opt(env, "SEARCH_DRIVER_MEMORY") or d.search_driver_memory,
            eval_s3_secret_name=_opt(env, "EVAL_S3_SECRET_NAME"),
            search_poll_seconds=_int(env, "SEARCH_POLL_SECONDS", d.search_poll_seconds),
            queue_name=_opt(env, "QUEUE_NAME"),
            kueue_admission_check=_bool(env, "KUEUE_ADMISSION_CHECK"),
        )
