"""The library of the LLM inference serving course.

Notebooks import it for everything that is not the lesson itself: runtime setup
(:mod:`course.env`), the models (:mod:`course.models`), live measurements
(:mod:`course.measure`), the shared records (:mod:`course.trace`, :mod:`course.workload`,
:mod:`course.geometry`, :mod:`course.hardware`), reference metrics (:mod:`course.metrics`), the
roofline (:mod:`course.roofline`), the streaming server and load client (:mod:`course.serving`),
the scheduler simulator (:mod:`course.sim`), the KV-cache calculator (:mod:`course.kv`), plots
(:mod:`course.plotting`) and test helpers (:mod:`course.grading`). Importing the package is
cheap: torch is imported only when a function needs it.
"""

from course.env import VERSION, in_colab, quick_mode, runtime_info, setup
from course.models import load_model
from course.progressbar import progress

__version__ = VERSION
__all__ = ["in_colab", "load_model", "progress", "quick_mode", "runtime_info", "setup"]
