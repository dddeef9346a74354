"""slipstream inside the training frameworks people already use.

One module per framework (``slipstream.integrations.lightning``, ...). Importing this
package imports no framework; each module imports its own when it is imported, and fails
with an ``ImportError`` naming the pip package to install when that framework is missing.
See docs/integrations.md.
"""
