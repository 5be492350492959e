"""The instructor side of the course: nbgrader configuration, release and grading.

``autograder release`` regenerates the student notebooks in ``modules/`` from the nbgrader
sources in ``solutions/``; :mod:`autograder.grading` autogrades notebooks through nbgrader.
"""
