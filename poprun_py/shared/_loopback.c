/* Binds to the wildcard address turned into binds to loopback, in a process that preloads this
 * library (LD_PRELOAD).
 *
 * Hydra's mpiexec and Open MPI's launcher, prterun, listen for their proxies and daemons on every
 * interface: they bind the wildcard address (prterun IPv4 and IPv6) whatever their settings say,
 * and prterun confined to the loopback interface finds none and refuses to start. A one-host job
 * starts no remote proxy or daemon, so poprun preloads this into the launcher of such a job and
 * nothing it opens is reachable from another machine. Binds to any
 * other address, and every other call, are passed on unchanged (poprun_py/shared/loopback.py).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len)
{
    static bind_fn next;
    if (next == NULL) {
        next = (bind_fn)dlsym(RTLD_NEXT, "bind");
        if (next == NULL) {
            errno = ENOSYS;
            return -1;
        }
    }
    if (addr != NULL && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) {
            in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return next(fd, (const struct sockaddr *)&in4, sizeof in4);
        }
    } else if (addr != NULL && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        if (memcmp(&in6.sin6_addr, &in6addr_any, sizeof in6addr_any) == 0) {
            in6.sin6_addr = in6addr_loopback;
            return next(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return next(fd, addr, len);
}
