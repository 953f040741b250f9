"""dtrain: a launcher for distributed training (``dtrain``, ``python -m launcher``)."""

from launcher.base import codecache

codecache.install()  # before any module of dtrain defines a dataclass
