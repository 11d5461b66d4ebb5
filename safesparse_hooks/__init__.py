"""safesparse's process-level hooks: what runs *before* safesparse (and torch) is imported.

Kept outside the ``safesparse`` package so that importing them costs no ``import torch``:

* :mod:`.env` - strict reading of ``SAFESPARSE_ENFORCE`` / ``SAFESPARSE_DEBUG``;
* :mod:`.startup` - the process-startup hook run by ``safesparse-startup.pth`` (installed into
  site-packages with the package): with one of the variables on, safesparse is imported right
  after the program's first ``import torch``;
* :mod:`.pytest_plugin` - the ``pytest --safesparse=enforce|debug`` option (a ``pytest11``
  entry point).

See docs/protecting.md.
"""
