"""genqueue's one import namespace.

The customer's folders `common/`, `producer/` and `consumer/` stay at the top of the tree;
they are installed (and imported) as `genqueue.common`, `genqueue.producer` and
`genqueue.consumer` through the links in this folder, so that PyPI's distributions named
`common` or `producer` can never overwrite them in site-packages.
"""
