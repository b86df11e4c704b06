/* poprun-stub: what mpiexec starts for each instance (`poprun-stub INDEX`).
 *
 * Only what must be done once per instance: fork and exec the program (its own process group,
 * killed if the stub dies), hand the read ends of its pipes to this host's supervisor, wait for
 * it, report how it ended, obey the supervisor's commands (TERMINATE, STOP, CONT, RELEASE), and
 * end with the program's status so that mpiexec passes it on. Everything else (output framing,
 * the connection to poprun, error files, ...) is done once per host by the supervisor.
 *
 * The supervisor listens on a Unix socket (POPRUN_STUB_SOCKET) in a directory only this user can
 * enter and checks each connection's peer credentials; the frames are poprun_py/wire/local.py's,
 * whose numbers are repeated here. poprun_py/stub/fallback.py does the same in Python where this
 * was not compiled. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* poprun_py/wire/local.py */
enum { HELLO = 'H', STARTED = 'F', NOT_STARTED = 'N', SIGNALLED = 'G', LAUNCHER_LOST = 'L', EXITED = 'X',
       PROGRAM = 'P', TERMINATE = 'T', STOP = 'S', CONT = 'C', RELEASE = 'R' };
enum { VERSION = 1, HEADER_SIZE = 5, PROGRAM_FIELDS = 13, PROGRAM_NO_STDIN = 1, PROGRAM_ONE_STREAM = 2,
       EXITED_WAS_STOPPED = 1, EXITED_MPI_ABORT = 2 };
#define MAX_PAYLOAD (8u << 20)
#define SOCKET_VARIABLE "POPRUN_STUB_SOCKET"
#define PYTHON_VARIABLE "POPRUN_PYTHON"
/* How long a stub waits for its host's supervisor, started by it or another stub, to listen. */
#define SUPERVISOR_START_MS 30000

/* The stub's status when it starts no program (poprun_py/stub/program.py's NOT_STARTED). */
#define NOT_STARTED_STATUS 1
/* After its report, the most a stub waits for RELEASE (fallback.RELEASE_WAIT_SECONDS). */
#define RELEASE_WAIT_MS 10000
/* How long the stub keeps killing what the program left (descendants it adopted) before it exits. */
#define LEFTOVER_WAIT_MS 2000
#define NEVER INT64_MAX
/* Without RELEASE, how long the stub waits, its PMI line closed, for its launcher to end the job
 * (fallback.LAUNCHER_NOTICE_SECONDS). */
#define LAUNCHER_NOTICE_MS 1000
/* The longest line from the program held back as a possible abort request (pmi_relay.HOLD_LIMIT). */
#define PMI_HOLD 65536
/* How long a holder keeps gforker's descriptors open for the stub to be reaped (program.HOLD_LIMIT). */
#define HOLD_MS 1000
/* Where Linux does not wake the holder when the stub is reaped, how often it looks. */
#define HOLD_CHECK_MS 2

static long instance = -1;

static void say(const char *format, ...) {
    char line[1024];
    va_list args;
    va_start(args, format);
    int n = snprintf(line, sizeof line, "poprun instance %ld: ", instance);
    if (n > 0 && (size_t)n < sizeof line)
        n += vsnprintf(line + n, sizeof line - (size_t)n, format, args);
    va_end(args);
    if (n < 0)
        return;
    size_t len = (size_t)n < sizeof line - 1 ? (size_t)n : sizeof line - 2;
    line[len] = '\n';
    (void)!write(2, line, len + 1);
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static uint64_t wall_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void put32(unsigned char *at, uint32_t value) { value = htonl(value); memcpy(at, &value, 4); }
static uint32_t get32(const unsigned char *at) { uint32_t v; memcpy(&v, at, 4); return ntohl(v); }
static void put64(unsigned char *at, uint64_t value) {
    put32(at, (uint32_t)(value >> 32));
    put32(at + 4, (uint32_t)value);
}

/* One frame, with `nfds` descriptors attached (SCM_RIGHTS) to its first byte. 0, or -1 (errno). */
static int send_frame(int sock, int kind, const unsigned char *payload, uint32_t size, const int *fds, int nfds) {
    unsigned char header[HEADER_SIZE];
    header[0] = (unsigned char)kind;
    put32(header + 1, size);
    struct iovec parts[2] = {{header, HEADER_SIZE}, {(void *)payload, size}};
    union { struct cmsghdr align; char room[CMSG_SPACE(2 * sizeof(int))]; } control;
    struct msghdr message = {.msg_iov = parts, .msg_iovlen = size ? 2 : 1};
    if (nfds > 0) {
        memset(&control, 0, sizeof control);
        message.msg_control = control.room;
        message.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
        struct cmsghdr *rights = CMSG_FIRSTHDR(&message);
        rights->cmsg_level = SOL_SOCKET;
        rights->cmsg_type = SCM_RIGHTS;
        rights->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
        memcpy(CMSG_DATA(rights), fds, (size_t)nfds * sizeof(int));
    }
    size_t total = HEADER_SIZE + size, sent = 0;
    while (sent < total) {
        ssize_t n = sendmsg(sock, &message, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        sent += (size_t)n;
        message.msg_control = NULL; /* the descriptors went with the first byte */
        message.msg_controllen = 0;
        /* what is left of the two parts */
        size_t skip = (size_t)n;
        while (message.msg_iovlen && skip >= message.msg_iov[0].iov_len) {
            skip -= message.msg_iov[0].iov_len;
            message.msg_iov++;
            message.msg_iovlen--;
        }
        if (message.msg_iovlen) {
            message.msg_iov[0].iov_base = (char *)message.msg_iov[0].iov_base + skip;
            message.msg_iov[0].iov_len -= skip;
        }
    }
    return 0;
}

static int read_all(int fd, unsigned char *into, size_t size) {
    while (size) {
        ssize_t n = read(fd, into, size);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        into += n;
        size -= (size_t)n;
    }
    return 0;
}

/* The next frame: its kind, and its payload in *payload (malloc'd, NUL-ended; free it). -1 when
 * the connection ended or failed, or the frame is longer than MAX_PAYLOAD. */
static int read_frame(int sock, int *kind, unsigned char **payload, uint32_t *size) {
    unsigned char header[HEADER_SIZE];
    if (read_all(sock, header, HEADER_SIZE) != 0)
        return -1;
    *kind = header[0];
    *size = get32(header + 1);
    if (*size > MAX_PAYLOAD)
        return -1;
    *payload = malloc((size_t)*size + 1);
    if (*payload == NULL)
        return -1;
    if (read_all(sock, *payload, *size) != 0) {
        free(*payload);
        return -1;
    }
    (*payload)[*size] = 0;
    return 0;
}

struct program {
    uint8_t flags;
    uint32_t grace_ms;
    char **argv;
};

/* PROGRAM's payload: its fields, then argc arguments and envc changes of the environment, each
 * NUL-ended (NAME=VALUE sets, NAME unsets). The changes are made here; argv points into payload. */
static int take_program(unsigned char *payload, uint32_t size, struct program *into) {
    if (size < PROGRAM_FIELDS)
        return -1;
    into->flags = payload[0];
    into->grace_ms = get32(payload + 1);
    uint32_t argc = get32(payload + 5), envc = get32(payload + 9);
    if (argc == 0 || argc > size || envc > size)
        return -1;
    into->argv = calloc((size_t)argc + 1, sizeof(char *));
    if (into->argv == NULL)
        return -1;
    char *item = (char *)payload + PROGRAM_FIELDS, *end = (char *)payload + size;
    for (uint32_t i = 0; i < argc + envc; i++) {
        char *nul = item < end ? memchr(item, 0, (size_t)(end - item)) : NULL;
        if (nul == NULL)
            return -1;
        if (i < argc) {
            into->argv[i] = item;
        } else {
            char *equals = strchr(item, '=');
            if (equals != NULL) {
                *equals = 0;
                if (setenv(item, equals + 1, 1) != 0)
                    return -1;
            } else if (unsetenv(item) != 0) {
                return -1;
            }
        }
        item = nul + 1;
    }
    return item == end ? 0 : -1;
}

/* What the stub knows of its program. */
static pid_t child = -1;
static int running = 0, status = 0, signum = 0, stopping = 0, was_stopped = 0;
static uint64_t ended_ns = 0, stop_begun_ns = 0;
static int64_t kill_at = NEVER;
/* A host's supervisor that the stub started (end_leftovers spares it), or -1. */
static pid_t supervisor = -1;
/* MPICH's PMI line: the launcher's end, the relay's, the program's (until it is started), what is
 * held of a line that may be an abort request, and the abort asked for (see open_pmi). */
static int pmi_launcher = -1, pmi_relay = -1, pmi_program = -1;
static char pmi_held[PMI_HOLD];
static size_t pmi_held_size = 0;
static int pmi_line_start = 1, aborted = 0, abort_code = 0;

/* Whether process `pid` is stopped (state T or t in /proc/PID/stat). */
/* Process `pid`'s /proc/PID/stat read into `text`: the fields after its command's name (the
 * state first), or NULL when it cannot be read. */
static const char *stat_fields(pid_t pid, char *text, size_t size) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    ssize_t n = read(fd, text, size - 1);
    close(fd);
    if (n <= 0)
        return NULL;
    text[n] = 0;
    char *paren = strrchr(text, ')');
    return paren != NULL && paren[1] == ' ' ? paren + 2 : NULL;
}

static int is_stopped(pid_t pid) {
    char text[512];
    const char *fields = stat_fields(pid, text, sizeof text);
    return fields != NULL && (fields[0] == 'T' || fields[0] == 't');
}

/* SIGTERM to the program's group (and SIGCONT: a stopped program must run to end), SIGKILL after
 * `grace_ms`. The group's leader is our unreaped child: its ID cannot have been reused. */
static void begin_stop(uint32_t grace_ms) {
    if (!running || stopping)
        return;
    stopping = 1;
    stop_begun_ns = wall_ns();
    was_stopped = is_stopped(child);
    killpg(child, SIGTERM);
    killpg(child, SIGCONT);
    kill_at = grace_ms == UINT32_MAX ? NEVER : now_ms() + grace_ms;
}

static void program_ended(int wait_status) {
    running = 0;
    if (aborted) { /* its status is the abort's low byte (1 for 0: the job did not finish) */
        status = (abort_code & 0xFF) != 0 ? abort_code & 0xFF : 1;
        kill_at = NEVER;
        return;
    }
    ended_ns = wall_ns();
    if (WIFSIGNALED(wait_status)) {
        signum = WTERMSIG(wait_status);
        status = 128 + signum;
    } else {
        status = WEXITSTATUS(wait_status);
    }
    kill_at = NEVER;
}

/* Collect every child that has ended (the program, and descendants of it the stub adopted as
 * their subreaper). */
static void reap(void) {
    int wait_status;
    pid_t pid;
    while ((pid = waitpid(-1, &wait_status, WNOHANG)) > 0)
        if (pid == child && running)
            program_ended(wait_status);
}

/* The stub's children, read from /proc/self/task/PID/children into `text`: NULL when that cannot
 * be read (a kernel without CONFIG_PROC_CHILDREN; the caller then scans /proc). */
static char *children(char *text, size_t size) {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)getpid());
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    ssize_t n = read(fd, text, size - 1);
    close(fd);
    text[n > 0 ? n : 0] = 0;
    return text;
}

/* The children of the stub by a scan of /proc (each process's parent, field 4 of its stat), as
 * children() lists them. */
static char *children_by_scan(char *text, size_t size) {
    char path[300], stat[512];
    size_t used = 0;
    text[0] = 0;
    DIR *proc = opendir("/proc");
    if (proc == NULL)
        return text;
    for (struct dirent *entry; (entry = readdir(proc)) != NULL;) {
        if (entry->d_name[0] < '1' || entry->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "/proc/%s/stat", entry->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, stat, sizeof stat - 1);
        close(fd);
        if (n <= 0)
            continue;
        stat[n] = 0;
        char *paren = strrchr(stat, ')');
        int parent = 0;
        if (paren != NULL && sscanf(paren + 1, " %*c %d", &parent) == 1 && parent == (int)getpid() &&
            used + strlen(entry->d_name) + 2 < size)
            used += (size_t)snprintf(text + used, size - used, "%s ", entry->d_name);
    }
    closedir(proc);
    return text;
}

/* SIGKILL what is left of the program's group and every child of the stub, until none is left
 * (what they leave comes to the stub, their subreaper) or LEFTOVER_WAIT_MS has passed. A child
 * cannot be reused before the stub reaps it, so no other process is hit. */
static void end_leftovers(void) {
    int64_t deadline = now_ms() + LEFTOVER_WAIT_MS;
    char text[4096];
    if (child > 0)
        killpg(child, SIGKILL);
    for (;;) {
        int wait_status;
        while (waitpid(-1, &wait_status, WNOHANG) > 0) {
        }
        char *listed = children(text, sizeof text);
        if (listed == NULL)
            listed = children_by_scan(text, sizeof text);
        int found = 0;
        for (char *word = strtok(listed, " \n"); word != NULL; word = strtok(NULL, " \n")) {
            pid_t pid = (pid_t)atoi(word);
            if (pid == supervisor)
                continue; /* the host's: it ends once every stub there has gone */
            kill(pid, SIGKILL);
            found = 1;
        }
        if (!found || now_ms() >= deadline)
            return;
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
    }
}

/* MPICH's PMI line (PMI_FD), relayed by the stub so that it is the first to know that its program
 * called MPI_Abort (poprun_py/stub/pmi_relay.py tells why; this is the same relay). The
 * program gets one end of a socket pair as the same descriptor number; an abort request
 * (`cmd=abort exitcode=N` at a line's start) is kept from the launcher: the stub kills the program
 * and reports the abort as its exit. Every other byte goes on at once. */

static void open_pmi(void) {
    const char *text = getenv("PMI_FD");
    char *end = NULL;
    long fd = text != NULL ? strtol(text, &end, 10) : -1;
    if (text == NULL || *text == 0 || *end != 0 || fd < 0 || fd > INT_MAX || fcntl((int)fd, F_GETFD) < 0)
        return;
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0)
        return;
    pmi_launcher = (int)fd;
    pmi_relay = pair[0];
    pmi_program = pair[1];
}

/* All of `data` to `fd`, waiting for room; dropped once it has closed. */
static void write_all(int fd, const char *data, size_t size) {
    while (size) {
        ssize_t n = write(fd, data, size);
        if (n < 0 && errno == EAGAIN) {
            struct pollfd room = {fd, POLLOUT, 0};
            poll(&room, 1, -1);
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        data += n;
        size -= (size_t)n;
    }
}

static int is_abort(const char *line, size_t size) {
    return size >= 9 && memcmp(line, "cmd=abort", 9) == 0 && (size == 9 || line[9] == ' ');
}

/* Whether a line's start so far may still become an abort request. */
static int may_be_abort(const char *line, size_t size) {
    return size < 9 ? memcmp(line, "cmd=abort", size) == 0 : is_abort(line, size);
}

static int exit_code(const char *line, size_t size) {
    char text[128];
    size_t n = size < sizeof text - 1 ? size : sizeof text - 1;
    memcpy(text, line, n);
    text[n] = 0;
    char *field = strstr(text, " exitcode=");
    if (field == NULL)
        return 1;
    char *end = NULL;
    long code = strtol(field + 10, &end, 10);
    return end == field + 10 || code < INT_MIN || code > INT_MAX ? 1 : (int)code;
}

static void abort_program(int code) {
    if (!running || stopping || aborted)
        return; /* an abort asked once the stop had begun is the stop's */
    aborted = 1;
    abort_code = code;
    ended_ns = wall_ns();
    killpg(child, SIGKILL);
}

/* What the program sent on its PMI line, passed on to the launcher but an abort request. */
static void pmi_from_program(void) {
    char data[65536];
    ssize_t n = read(pmi_relay, data, sizeof data);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n <= 0) {
        close(pmi_relay);
        pmi_relay = -1;
        return;
    }
    size_t at = 0, size = (size_t)n;
    while (at < size) {
        char *newline = memchr(data + at, '\n', size - at);
        size_t end = newline != NULL ? (size_t)(newline - data) + 1 : size;
        if (!pmi_line_start) { /* the rest of a line that is no abort request */
            write_all(pmi_launcher, data + at, end - at);
        } else if (pmi_held_size + (end - at) > sizeof pmi_held) { /* too long to be one */
            write_all(pmi_launcher, pmi_held, pmi_held_size);
            write_all(pmi_launcher, data + at, end - at);
            pmi_held_size = 0;
        } else {
            memcpy(pmi_held + pmi_held_size, data + at, end - at);
            pmi_held_size += end - at;
            size_t line = pmi_held_size - (newline != NULL);
            if (newline != NULL && is_abort(pmi_held, line)) {
                abort_program(exit_code(pmi_held, line));
                pmi_held_size = 0;
                return;
            }
            if (newline == NULL && may_be_abort(pmi_held, line))
                return; /* the rest of the line decides */
            write_all(pmi_launcher, pmi_held, pmi_held_size);
            pmi_held_size = 0;
        }
        pmi_line_start = newline != NULL;
        at = end;
    }
}

/* What the launcher sent, passed on to the program; at the line's end, the program's is shut. */
static void pmi_from_launcher(void) {
    char data[65536];
    ssize_t n = read(pmi_launcher, data, sizeof data);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n <= 0) {
        if (pmi_relay >= 0)
            shutdown(pmi_relay, SHUT_RDWR);
        close(pmi_launcher);
        pmi_launcher = -1;
        return;
    }
    if (pmi_relay >= 0)
        write_all(pmi_relay, data, (size_t)n);
}

/* The start time of process `pid` (field 22 of its stat), or 0 once it is gone or reaped. */
static unsigned long long start_time(pid_t pid) {
    char text[1024];
    const char *fields = stat_fields(pid, text, sizeof text);
    unsigned long long started = 0;
    if (fields == NULL || fields[0] == 'Z' || fields[0] == 'X' ||
        sscanf(fields, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
               &started) != 1)
        return 0;
    return started;
}

/* Close descriptors `first` to `last`: close_range where the kernel has it (Linux 5.9; called
 * by its number, as C libraries before 2.34 lack the function), else one by one. */
static void close_between(unsigned first, unsigned last) {
#ifdef SYS_close_range
    if (syscall(SYS_close_range, first, last, 0) == 0)
        return;
#endif
    long most = sysconf(_SC_OPEN_MAX);
    for (long fd = first; fd <= (long)last && fd < most && fd < 65536; fd++)
        close((int)fd);
}

/* Under MPICH's gforker, the stub's last act (poprun_py/stub/program.py's `leave` tells why): a
 * holder keeps stdin, stdout, stderr and the PMI line open until gforker has reaped the stub, so
 * that the last of them closes once gforker knows it exited. The holder sleeps on a pidfd of the
 * stub, which Linux wakes with EPOLLHUP when the stub is reaped (6.9 on); where it is not woken,
 * it looks every HOLD_CHECK_MS. */
static void hold_until_reaped(void) {
    char path[64], exe[PATH_MAX];
    snprintf(path, sizeof path, "/proc/%d/exe", (int)getppid());
    ssize_t n = readlink(path, exe, sizeof exe - 1);
    if (n <= 0)
        return;
    exe[n] = 0;
    const char *base = strrchr(exe, '/');
    if (strcmp(base != NULL ? base + 1 : exe, "mpiexec.gforker") != 0)
        return;
    pid_t me = getpid();
    unsigned long long born = start_time(me);
    if (born == 0 || fork() != 0)
        return; /* (no holder: gforker may wait its 2 s, nothing worse) */
    int keep = pmi_launcher > 2 ? pmi_launcher : 2;
    if (keep > 3)
        close_between(3, (unsigned)keep - 1);
    close_between((unsigned)keep + 1, ~0u);
#ifdef SYS_pidfd_open
    int stub = (int)syscall(SYS_pidfd_open, me, 0);
#else
    int stub = -1;
#endif
    int watch = stub >= 0 ? epoll_create1(EPOLL_CLOEXEC) : -1;
    struct epoll_event wanted = {.events = EPOLLIN | EPOLLHUP | EPOLLET};
    if (watch >= 0 && epoll_ctl(watch, EPOLL_CTL_ADD, stub, &wanted) != 0) {
        close(watch);
        watch = -1;
    }
    int64_t deadline = now_ms() + HOLD_MS;
    for (int64_t left; (left = deadline - now_ms()) > 0;) {
        struct epoll_event event = {0};
        if (watch >= 0) {
            int woken = epoll_wait(watch, &event, 1, left < HOLD_CHECK_MS ? (int)left : HOLD_CHECK_MS);
            if (woken > 0 && (event.events & EPOLLHUP))
                break; /* reaped */
            if (woken > 0)
                continue; /* it exited; its reaping wakes this again */
        } else {
            struct timespec pause = {0, HOLD_CHECK_MS * 1000000L};
            nanosleep(&pause, NULL);
        }
        if (start_time(me) != born)
            break;
    }
    _exit(0);
}

/* `path`, then up to `levels` of the folders above it, each while empty (root_cause.remove). */
static void remove_with_folders(const char *path, int levels) {
    char *copy = strdup(path);
    if (copy == NULL)
        return;
    unlink(copy);
    for (int i = 0; i < levels; i++) {
        char *slash = strrchr(copy, '/');
        if (slash == NULL || slash == copy)
            break;
        *slash = 0;
        rmdir(copy);
    }
    free(copy);
}

/* The supervisor died (a supervisor that ends removes these itself): what it made on this host
 * for the job goes with its stubs, so that nothing is left behind: the socket and its private
 * folder, this instance's error file and, once empty, the job's folder it is in. */
static void remove_what_the_supervisor_left(const char *socket_path) {
    remove_with_folders(socket_path, 1);
    const char *error_file = getenv("TORCHELASTIC_ERROR_FILE");
    if (error_file != NULL && *error_file != 0)
        remove_with_folders(error_file, 1);
}

static int connect_to_supervisor(const char *path) {
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof address.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(address.sun_path, path);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return -1;
    if (connect(sock, (struct sockaddr *)&address, sizeof address) != 0) {
        int saved = errno;
        close(sock);
        errno = saved;
        return -1;
    }
    return sock;
}

/* Whether `folder` is a folder of this user's that no one else may enter. */
static int private_folder(const char *folder) {
    struct stat info;
    return lstat(folder, &info) == 0 && S_ISDIR(info.st_mode) && info.st_uid == geteuid() &&
           (info.st_mode & 077) == 0;
}

/* Start the host's supervisor, `python -S .../poprun_py/host/script.py` (the package beside this
 * program's folder), as a child that outlives nothing it needs: it ends when its stubs have gone. */
static int start_supervisor(const char *python) {
    char script[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", script, sizeof script - 32);
    if (n <= 0)
        return -1;
    script[n] = 0;
    char *slash = strrchr(script, '/');
    if (slash == NULL)
        return -1;
    strcpy(slash, "/../host/script.py");
    supervisor = fork();
    if (supervisor == 0) {
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0 && devnull != 0) {
            dup2(devnull, 0);
            close(devnull);
        }
        execl(python, python, "-S", script, (char *)NULL);
        say("cannot start its host's supervisor with %s (%s)", python, strerror(errno));
        _exit(127);
    }
    return supervisor > 0 ? 0 : -1;
}

/* The connection to this host's supervisor at `path`. On poprun's own host poprun listens there; on
 * another host the first stub of the job to make the socket's folder starts the supervisor, and
 * every stub waits for it to listen. -1 (errno) when it cannot be reached. */
static int reach_supervisor(const char *path) {
    int sock = connect_to_supervisor(path);
    const char *python = getenv(PYTHON_VARIABLE);
    if (sock >= 0 || (errno != ENOENT && errno != ECONNREFUSED) || python == NULL || *python == 0)
        return sock;
    char folder[PATH_MAX], job[PATH_MAX];
    snprintf(folder, sizeof folder, "%s", path);
    char *slash = strrchr(folder, '/');
    if (slash == NULL || slash == folder) {
        errno = EINVAL;
        return -1;
    }
    *slash = 0;
    snprintf(job, sizeof job, "%s", folder);
    slash = strrchr(job, '/');
    if (slash == NULL || slash == job) {
        errno = EINVAL;
        return -1;
    }
    *slash = 0;
    if ((mkdir(job, 0700) != 0 && errno != EEXIST) || !private_folder(job)) {
        errno = errno == EEXIST ? EPERM : errno;
        return -1;
    }
    if (mkdir(folder, 0700) == 0) {
        if (start_supervisor(python) != 0)
            return -1;
    } else if (errno != EEXIST || !private_folder(folder)) {
        errno = errno == EEXIST ? EPERM : errno;
        return -1;
    }
    int64_t deadline = now_ms() + SUPERVISOR_START_MS;
    for (;;) {
        sock = connect_to_supervisor(path);
        if (sock >= 0 || (errno != ENOENT && errno != ECONNREFUSED))
            return sock;
        int wait_status;
        if (supervisor > 0 && waitpid(supervisor, &wait_status, WNOHANG) == supervisor) {
            supervisor = -1; /* it said why on stderr; what it did not remove goes, if empty */
            rmdir(folder);
            rmdir(job);
            errno = ECHILD;
            return -1;
        }
        if (now_ms() >= deadline) {
            errno = ETIMEDOUT;
            return -1;
        }
        struct timespec pause = {0, 2000000};
        nanosleep(&pause, NULL);
    }
}

/* Fork and exec the program; its pipes' read ends in out[0] and err[0] (-1: one stream). The
 * errno of a failed exec, or 0. */
static int start(const struct program *program, const sigset_t *original, int *out, int *err) {
    int report[2];
    int one_stream = program->flags & PROGRAM_ONE_STREAM;
    if (pipe2(out, O_CLOEXEC) != 0)
        return errno;
    if (one_stream) {
        err[0] = err[1] = -1;
    } else if (pipe2(err, O_CLOEXEC) != 0) {
        int saved = errno;
        close(out[0]);
        close(out[1]);
        return saved;
    }
    if (pipe2(report, O_CLOEXEC) != 0) {
        int saved = errno;
        for (int i = 0; i < 2; i++) {
            close(out[i]);
            if (!one_stream)
                close(err[i]);
        }
        return saved;
    }
    pid_t parent = getpid();
    child = vfork(); /* (the child only sets itself up and execs: no copy of the stub's memory) */
    if (child == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127); /* the stub died before the death signal was set */
        int stdin_fd = (program->flags & PROGRAM_NO_STDIN) ? open("/dev/null", O_RDONLY) : 0;
        if (stdin_fd < 0 || dup2(out[1], 1) < 0 || dup2(one_stream ? out[1] : err[1], 2) < 0 ||
            (stdin_fd != 0 && (dup2(stdin_fd, 0) < 0 || close(stdin_fd) != 0))) {
            int e = errno;
            (void)!write(report[1], &e, sizeof e);
            _exit(127);
        }
        if (pmi_program >= 0 && dup2(pmi_program, pmi_launcher) < 0) {
            int e = errno;
            (void)!write(report[1], &e, sizeof e);
            _exit(127);
        }
        signal(SIGPIPE, SIG_DFL);
        signal(SIGXFSZ, SIG_DFL);
        sigprocmask(SIG_SETMASK, original, NULL);
        execvp(program->argv[0], program->argv);
        int e = errno;
        (void)!write(report[1], &e, sizeof e);
        _exit(127);
    }
    int e = child < 0 ? errno : 0;
    if (pmi_program >= 0) {
        close(pmi_program);
        pmi_program = -1;
    }
    close(out[1]);
    if (!one_stream)
        close(err[1]);
    close(report[1]);
    if (child > 0) {
        running = 1;
        int reported;
        if (read_all(report[0], (unsigned char *)&reported, sizeof reported) == 0) {
            e = reported;
            int wait_status;
            while (waitpid(child, &wait_status, 0) < 0 && errno == EINTR) {
            }
            running = 0;
        }
    }
    close(report[0]);
    if (e != 0) {
        close(out[0]);
        if (!one_stream)
            close(err[0]);
    }
    return e;
}

int main(int argc, char **argv) {
    char *end = NULL;
    if (argc != 2 || (instance = strtol(argv[1], &end, 10)) < 0 || *end != 0 || end == argv[1]) {
        instance = -1;
        say("usage: poprun-stub INDEX (mpiexec starts it for poprun)");
        return 2;
    }
    /* A stderr whose reader went away must not end the stub (and with it, its program): its
     * writes fail instead. The program gets the default back before its exec. */
    signal(SIGPIPE, SIG_IGN);
    /* (a copy: PROGRAM takes the variable out of the environment the program inherits) */
    static char path[PATH_MAX];
    const char *given = getenv(SOCKET_VARIABLE);
    if (given == NULL || *given == 0 || strlen(given) >= sizeof path) {
        say("no " SOCKET_VARIABLE " in its environment (was it dropped by mpiexec's options?); "
            "the program was not started");
        return NOT_STARTED_STATUS;
    }
    strcpy(path, given);
    int sock = reach_supervisor(path);
    if (sock < 0 && errno == ECHILD) {
        say("its host's supervisor, which it started, exited before it listened (it said why); "
            "the program was not started");
        return NOT_STARTED_STATUS;
    }
    if (sock < 0) {
        say("cannot reach its host's supervisor at %s (%s); the program was not started", path, strerror(errno));
        return NOT_STARTED_STATUS;
    }
    unsigned char hello[8];
    put32(hello, VERSION);
    put32(hello + 4, (uint32_t)instance);
    int kind;
    unsigned char *payload = NULL;
    uint32_t size = 0;
    struct program program = {0};
    if (send_frame(sock, HELLO, hello, sizeof hello, NULL, 0) != 0 || read_frame(sock, &kind, &payload, &size) != 0 ||
        kind != PROGRAM || take_program(payload, size, &program) != 0) {
        say("did not receive the program from its host's supervisor; the program was not started");
        return NOT_STARTED_STATUS;
    }

    /* From here every signal that matters arrives through `signals`. */
    sigset_t handled, original;
    sigemptyset(&handled);
    int asked[] = {SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
    for (size_t i = 0; i < sizeof asked / sizeof *asked; i++)
        sigaddset(&handled, asked[i]);
    sigprocmask(SIG_BLOCK, &handled, &original);
    int signals = signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);
    prctl(PR_SET_CHILD_SUBREAPER, 1);

    /* The process that started the stub (its host's MPI daemon, or mpiexec): when it dies, the
     * MPI job on this host is broken, and the program is stopped at once. */
    pid_t launcher = getppid();
#ifdef SYS_pidfd_open
    int launcher_fd = launcher > 1 ? (int)syscall(SYS_pidfd_open, launcher, 0) : -1;
#else
    int launcher_fd = -1;
#endif

    open_pmi();
    int out[2], err[2];
    int failed = start(&program, &original, out, err);
    if (failed != 0) {
        unsigned char code[4];
        put32(code, (uint32_t)failed);
        send_frame(sock, NOT_STARTED, code, 4, NULL, 0);
        status = failed == ENOENT ? 127 : 126;
    } else {
        unsigned char pid[4];
        put32(pid, (uint32_t)child);
        int fds[2] = {out[0], err[0]};
        if (send_frame(sock, STARTED, pid, 4, fds, err[0] >= 0 ? 2 : 1) != 0)
            begin_stop(program.grace_ms);
        close(out[0]);
        if (err[0] >= 0)
            close(err[0]);
    }
    free(payload);
    payload = NULL;

    int connected = 1, reported = failed != 0;
    int64_t release_at = failed != 0 ? now_ms() + RELEASE_WAIT_MS : NEVER;
    for (;;) {
        if (!running && !reported) {
            unsigned char fields[28];
            put32(fields, (uint32_t)status);
            put32(fields + 4, (uint32_t)signum);
            put32(fields + 8, (was_stopped ? EXITED_WAS_STOPPED : 0) | (aborted ? EXITED_MPI_ABORT : 0));
            put64(fields + 12, ended_ns);
            put64(fields + 20, stop_begun_ns);
            if (connected && send_frame(sock, EXITED, fields, sizeof fields, NULL, 0) != 0)
                connected = 0;
            reported = 1;
            release_at = now_ms() + RELEASE_WAIT_MS;
        }
        if (pmi_relay >= 0 && !running) { /* the program's end of the line is gone with it */
            close(pmi_relay);
            pmi_relay = -1;
        }
        if (reported && connected && now_ms() >= release_at && release_at != 0 && pmi_launcher >= 0) {
            /* No RELEASE came: other instances still run. The PMI line is closed first, and the
             * launcher given LAUNCHER_NOTICE_MS to end the job (pmi_relay.py's
             * hang_up tells why). */
            close(pmi_launcher);
            pmi_launcher = -1;
            release_at = now_ms() + LAUNCHER_NOTICE_MS;
        }
        if (reported && (!connected || now_ms() >= release_at))
            break;
        if (kill_at != NEVER && now_ms() >= kill_at) {
            killpg(child, SIGKILL);
            kill_at = NEVER;
        }
        int64_t wake = kill_at < release_at ? kill_at : release_at;
        int timeout = wake == NEVER ? -1 : (int)(wake - now_ms() > 0 ? wake - now_ms() : 0);
        struct pollfd watched[5] = {
            {signals, POLLIN, 0}, {connected ? sock : -1, POLLIN, 0}, {launcher_fd, POLLIN, 0},
            {pmi_relay, POLLIN, 0}, {running ? pmi_launcher : -1, POLLIN, 0}};
        if (poll(watched, 5, timeout) < 0 && errno != EINTR)
            break;
        if (watched[3].revents)
            pmi_from_program();
        if (watched[4].revents && pmi_launcher >= 0)
            pmi_from_launcher();
        if (watched[2].revents) {
            close(launcher_fd);
            launcher_fd = -1;
            if (running && !stopping) {
                unsigned char which[4];
                put32(which, (uint32_t)launcher);
                if (connected && send_frame(sock, LAUNCHER_LOST, which, 4, NULL, 0) != 0)
                    connected = 0;
                begin_stop(program.grace_ms);
            }
        }
        if (watched[0].revents) {
            struct signalfd_siginfo info;
            while (read(signals, &info, sizeof info) == (ssize_t)sizeof info) {
                if (info.ssi_signo == SIGCHLD)
                    continue;
                /* signalled by its launcher (mpiexec ending the job) or by hand: stop the program */
                if (running && !stopping) {
                    unsigned char which[4];
                    put32(which, info.ssi_signo);
                    if (connected && send_frame(sock, SIGNALLED, which, 4, NULL, 0) != 0)
                        connected = 0;
                    begin_stop(program.grace_ms);
                } else if (!running) {
                    release_at = 0; /* its report is made: leave */
                }
            }
            reap();
        }
        if (watched[1].revents) {
            if (read_frame(sock, &kind, &payload, &size) != 0) {
                connected = 0; /* the supervisor is gone: nobody will read the program's output */
                begin_stop(program.grace_ms);
                continue;
            }
            if (kind == TERMINATE && size >= 4)
                begin_stop(get32(payload));
            else if (kind == STOP && running)
                killpg(child, SIGSTOP);
            else if (kind == CONT && running)
                killpg(child, SIGCONT);
            else if (kind == RELEASE && !running)
                release_at = 0;
            free(payload);
            payload = NULL;
        }
    }
    end_leftovers();
    if (!connected)
        remove_what_the_supervisor_left(path);
    hold_until_reaped();
    return status;
}
