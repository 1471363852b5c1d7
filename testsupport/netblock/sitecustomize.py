"""Block every network connection except loopback in the process that imports this module.

The tests put this folder first on PYTHONPATH (see offline_environment in ../trees.py), so Python imports
it at start-up, before any code under test runs. Loopback stays open: torch.distributed rendezvous
and the tests' own local servers use it. Everything else fails at once with an OSError, which is
what an offline machine gives (urllib turns it into URLError), so code that would download
something fails quickly and visibly instead of hanging or silently succeeding.
"""
import ipaddress
import socket

MESSAGE = 'network blocked by the yolov9-ddp tests'
LOOPBACK_NAMES = {'localhost', 'localhost.localdomain', 'ip6-localhost', 'ip6-loopback'}


def _is_loopback(host) -> bool:
    if host is None:  # getaddrinfo(None, port): the local wildcard address, used by servers
        return True
    if isinstance(host, bytes):
        host = host.decode('ascii', 'replace')
    host = str(host).strip('[]').split('%', 1)[0].lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def _check_address(address):
    # AF_UNIX addresses are paths (str or bytes): local by definition. IP addresses are (host, port, ...).
    if isinstance(address, tuple) and address and not _is_loopback(address[0]):
        raise OSError(f'{MESSAGE}: connection to {address[0]!r}')


def _install():
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_create_connection, real_getaddrinfo = socket.create_connection, socket.getaddrinfo

    def connect(self, address):
        _check_address(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        _check_address(address)
        return real_connect_ex(self, address)

    def create_connection(address, *args, **kwargs):
        _check_address(address)
        return real_create_connection(address, *args, **kwargs)

    def getaddrinfo(host, *args, **kwargs):
        if not _is_loopback(host):
            raise OSError(f'{MESSAGE}: name lookup of {host!r}')
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
    socket.create_connection, socket.getaddrinfo = create_connection, getaddrinfo
    socket.NETWORK_BLOCKED_BY_YOLOV9_DDP_TESTS = True  # lets a test check that this module is active


_install()
