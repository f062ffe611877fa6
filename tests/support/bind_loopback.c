/* LD_PRELOAD shim keeping wildcard listeners on loopback (see tests/support/loopback.py).
 *
 * Mooncake's transfer engine opens two listeners per engine, its handshake (RPC) port on 0.0.0.0
 * and its TCP data port on the IPv6 wildcard ::, whatever hostname it is given and whatever
 * MC_TCP_BIND_ADDRESS says. Under this shim a bind() to 0.0.0.0 becomes a bind() to 127.0.0.1,
 * and a bind() to :: becomes a bind() to ::ffff:127.0.0.1 (the IPv4-mapped loopback address, so
 * IPv4 clients connecting to 127.0.0.1 still reach the dual-stack socket). Every other bind() is
 * passed through unchanged.
 *
 * Build: cc -shared -fPIC -O2 -o bind_loopback.so bind_loopback.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 &&
               len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (memcmp(&a.sin6_addr, &in6addr_any, sizeof a.sin6_addr) == 0) {
            static const unsigned char mapped_lo[16] = {0, 0, 0, 0, 0, 0, 0, 0,
                                                        0, 0, 0xff, 0xff, 127, 0, 0, 1};
            memcpy(&a.sin6_addr, mapped_lo, sizeof mapped_lo);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
