"""The shared benchmark helpers, for the scripts here: they live in moorline.benchmarks.common."""

from moorline.benchmarks.common import analyze as analyze
from moorline.benchmarks.common import on_fresh_database as on_fresh_database
from moorline.benchmarks.common import percentile as percentile
from moorline.benchmarks.common import seed_tenant as seed_tenant
from moorline.benchmarks.common import summary as summary
