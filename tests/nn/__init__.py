"""Tests of cairn.nn (a package so the test modules can share ``_nn_helpers``)."""
