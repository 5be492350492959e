"""``course.sim.rules`` is :mod:`course.rules`, the scheduling rules, by the name module 3's notebook and
earlier code use.

The name is bound to the same module object, not to a copy of its names, so that whatever watches
``course.sim.rules`` watches the rules themselves: module 3's tests forbid a learner's answer to call them
(``course.grading.forbid_reference`` looks at the file a called function is defined in).
"""

import sys

from course import rules

sys.modules[__name__] = rules
