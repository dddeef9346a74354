"""Adapters that plug slipstream into other frameworks' extension points.

Each module imports its framework: import only the one you use (``slipstream`` itself never
imports these).
"""
