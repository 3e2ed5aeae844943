"""The parts of the custom resources' pydantic models every kind shares: the API group and
version, the wire conventions (:class:`K8sModel`: camelCase names, unknown fields refused), the
field patterns (Go RE2 syntax) and types, and the conditions every status carries.

Each resource's own models live with it (``modelmerge/model.py``, ``snapshot/model.py``,
``quota/model.py``, ``search/model.py``); :mod:`mergepipe_operator.crd` lists the kinds for
``crdgen``."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StringConstraints, WithJsonSchema
from pydantic.alias_generators import to_camel

from ..quantities import BYTES_PATTERN, QuantityError, parse_quantity

GROUP = "mergepipe.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# --- patterns (Go RE2 syntax: no look-around; also valid Python `re`) -------------------------

#: A byte quantity as a string: a decimal number and an optional unit. SI units (k/K, M, G, T, P,
#: E; optional "B") are powers of 1000, binary units (Ki, Mi, Gi, Ti, Pi, Ei; optional "B") are
#: powers of 1024, "B" or no unit means bytes. Examples: "512MiB", "10Gi", "1G", "1.5TB".
#: A Kubernetes resource quantity (the pattern kubebuilder emits for resource.Quantity).
K8S_QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
#: An S3 URI: bucket name rules (3-63 chars, lowercase, digits, dots, hyphens), optional key prefix.
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$"
#: An S3 URI with a non-empty key prefix (outputs never go to a bucket root).
S3_PREFIX_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\s]*[^\s/][^\s]*$"
HTTP_URL_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
#: An extended resource name such as "nvidia.com/gpu" or "amd.com/gpu".
RESOURCE_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
#: A duration such as "30m", "24h", "7d", "1h30m" (s, m, h, d, w).
DURATION_PATTERN = r"^([0-9]+[smhdw])+$"
IMAGE_PATTERN = r"^[^\s]+$"
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class K8sModel(BaseModel):
    """Base: camelCase field names on the wire, unknown fields refused (the API server prunes
    them anyway; refusing them here catches typos in manifests validated offline)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# --- shared field types -----------------------------------------------------------------------


def _whole_bytes(value: int | str) -> int | str:
    """A byte quantity the model accepts is one :func:`~mergepipe_operator.quantities.parse_quantity`
    reads as at least 1 byte (the pattern alone admits ``"0"`` or ``"1.5B"``); the value is kept
    as written (``budget_bytes`` properties give the bytes)."""
    try:
        n = parse_quantity(value)
    except QuantityError as e:  # the message without parse_quantity's field prefix
        raise ValueError(str(e).split(": ", 1)[-1]) from None
    if n < 1:
        raise ValueError("must be at least 1 byte")
    return value


#: A byte quantity field (budgets, quota limits): an integer >= 1 or a string in
#: :data:`~mergepipe_operator.quantities.BYTES_PATTERN`, read by its one parser.
ByteQuantity = Annotated[
    Annotated[StrictInt, Field(ge=1)] | Annotated[str, StringConstraints(pattern=BYTES_PATTERN)],
    AfterValidator(_whole_bytes),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": BYTES_PATTERN,
            "minimum": 1,
        }
    ),
]

K8sQuantity = Annotated[
    Annotated[StrictInt, Field(ge=0)] | Annotated[str, StringConstraints(pattern=K8S_QUANTITY_PATTERN)],
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": K8S_QUANTITY_PATTERN,
        }
    ),
]

S3Uri = Annotated[str, StringConstraints(pattern=S3_URI_PATTERN, max_length=1024)]
S3PrefixUri = Annotated[str, StringConstraints(pattern=S3_PREFIX_URI_PATTERN, max_length=1024)]
Sha256 = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]
DnsLabel = Annotated[str, StringConstraints(pattern=DNS_LABEL_PATTERN, max_length=63)]
DnsSubdomain = Annotated[str, StringConstraints(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]
Duration = Annotated[str, StringConstraints(pattern=DURATION_PATTERN, max_length=32)]
Timestamp = Annotated[datetime, WithJsonSchema({"type": "string", "format": "date-time"})]
NonNegInt = Annotated[int, Field(ge=0)]

#: The most pods one merge may run as (spec.parallelism); the chart's merges.parallelism.max bounds
#: it further. Kubernetes allows 100,000 completions for an Indexed Job with per-index backoff.
MAX_PARALLELISM = 1024

#: The largest seed the CRDs accept: 2**53 - 1, the largest integer every JSON reader keeps exactly
#: (JavaScript, Argo CD's UI, any float64 parser). A seed only names random streams (the DARE/DELLA
#: streams are keyed by a SHA-256 of its decimal string; the search seeds torch generators with it),
#: so this range is ample. 2**63 - 1 is not usable: the API server keeps schema bounds as float64,
#: where it rounds to 2**63, and refuses the CRD ("Maximum boundary value must be of type integer").
SEED_MAX = 2**53 - 1
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]


class Condition(K8sModel):
    """A condition, following the Kubernetes API conventions (metav1.Condition)."""

    type: Annotated[str, StringConstraints(pattern=CONDITION_TYPE_PATTERN, max_length=316)] = Field(
        description="Condition type, e.g. Ready."
    )
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[str, StringConstraints(pattern=CONDITION_REASON_PATTERN, min_length=1, max_length=1024)] = Field(
        description="CamelCase reason for the last transition."
    )
    message: Annotated[str, StringConstraints(max_length=32768)] = Field(description="Human-readable details.")
    last_transition_time: Timestamp = Field(description="When status last changed.")
    observed_generation: NonNegInt | None = Field(
        default=None, description="metadata.generation this condition was computed from."
    )


class ObservedStatus(K8sModel):
    """Base of the three kinds' statuses: the generation observed and the conditions (the summary
    condition is Ready), first in every status, as the API conventions name them."""

    observed_generation: NonNegInt | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "maxItems": 16,
        },
        description="Observations of the object's state; the summary condition is Ready.",
    )


class IOBytes(K8sModel):
    """Bytes per role of a merge (base read, expert read, output write)."""

    base_read_bytes: NonNegInt | None = None
    expert_read_bytes: NonNegInt | None = None
    output_write_bytes: NonNegInt | None = None
