"""Adapters that put slipstream under the training frameworks people already use.

Each submodule imports its framework only when it is imported itself, and fails with an
``ImportError`` naming the pip package when the framework is missing.
"""
