"""The instructor side of the course: nbgrader configuration, release and the grading pipeline.

``autograder release`` regenerates the student notebooks in ``modules/`` from the nbgrader sources
in ``solutions/``. The grading pipeline (``autograder collect``, ``repair``, ``grade``, ``feedback``,
``export``, or all of them with ``run``) takes a class's submissions from an LMS download to grades,
grading every student in a bubblewrap sandbox (:mod:`autograder.sandbox`); ``autograder check``
lets a learner grade their own notebook. :func:`autograder.throwaway.autograde` grades notebooks
in a throwaway course directory (the tests' grading contract).
"""
