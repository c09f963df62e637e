"""Negotiation: everything that decides who writes which bytes where (see README.md here).

Pure: no sockets, threads, event loops, gRPC or engines. Per decode peer, from the pair
(``PrefillServerInfo``, ``KvRegistration``): the layout verdict (``topology``), the TP
mapping (``tpmap``, ``senders``, ``shards``, ``extras``), the multi-host reach rule
(``reach``), the deployment checks (``config``) and the decode's registration builder
(``registration``); per request, which aux and state items move (``slots``) and the decode's
outcome over several prefill ranks (``fanin``). Import the module you need; this package
re-exports nothing, so loading one rule loads no other.
"""
