# lossy.py server|client HOST PORT SIZE N PROBES REPEAT_MS RTO_US
import socket, sys, time, struct, select
mode, host, port, size, n, probes, repeat_ms, rto = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]), int(sys.argv[8])
def tune(s):
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if rto: s.setsockopt(socket.IPPROTO_TCP, 45, rto); s.setsockopt(socket.IPPROTO_TCP, 46, rto)
class Reader:
    def __init__(s, sock): s.sock = sock; s.buf = bytearray()
    def frame(s, timeout=None):
        # returns payload of the next non-empty frame, or None on timeout
        while True:
            while len(s.buf) >= 4:
                k = struct.unpack('!I', s.buf[:4])[0]
                if len(s.buf) < 4 + k: break
                p = s.buf[4:4 + k]; del s.buf[:4 + k]
                if k: return p
            if timeout is not None:
                r, _, _ = select.select([s.sock], [], [], timeout)
                if not r: return None
            c = s.sock.recv(1 << 20)
            if not c: raise EOFError
            s.buf += c
PROBE = struct.pack('!I', 0)
def send_probes(s, k):
    for _ in range(k): s.send(PROBE)
if mode == 'server':
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind((host, port)); l.listen(1)
    c, _ = l.accept(); tune(c); r = Reader(c)
    try:
        while True:
            r.frame(); c.sendall(struct.pack('!I', 40) + b'x' * 40); send_probes(c, probes)
    except EOFError: pass
else:
    s = socket.create_connection((host, port)); tune(s); r = Reader(s)
    msg = struct.pack('!I', size) + b'y' * size
    lat = []
    for i in range(n):
        t = time.perf_counter(); s.sendall(msg); send_probes(s, probes)
        if repeat_ms > 0:
            left = 8
            while r.frame(repeat_ms / 1e3) is None:
                if left: s.send(PROBE); left -= 1
        else:
            r.frame()
        lat.append((time.perf_counter() - t) * 1e3)
        time.sleep(0.002)
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(len(lat) * p))]
    print(f'size {size} probes {probes} repeat {repeat_ms}: mean {sum(lat)/len(lat):.3f} p50 {q(.5):.3f} p90 {q(.9):.3f} p95 {q(.95):.3f} p99 {q(.99):.3f} max {lat[-1]:.1f} ms')
