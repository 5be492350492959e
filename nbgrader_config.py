# nbgrader configuration of this course, read by `nbgrader ...` run from the repository root.
# Everything lives in autograder/config.py so the CLI, the tests and the autograder agree.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autograder.config import configure  # noqa: E402

configure(get_config(), root=os.path.dirname(os.path.abspath(__file__)))  # noqa: F821
