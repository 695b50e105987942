/*
 * vmport: the guest end of a VM's agent channel. A microVM links it into vminit (which runs
 * vmport_main in a child once the root is switched); the full VM's Debian image runs it as
 * a program of its own (built with -DVMPORT_CLI, no arguments: dsec-vmport.service). The
 * wire protocol is the one dsec.edge.backends.microvm.frames documents (frames, HELLO/READY
 * with the identity, per-channel flow control by CREDIT); the host end is
 * dsec.edge.backends.microvm.mux.
 *
 * Why C: under TCG a restored or forked guest translates again all the code it runs. A
 * Python multiplexer ran the interpreter, json and its threads for the HELLO and each
 * frame of the first call; this runs a few kilobytes of code in one thread.
 *
 * One thread, poll(): the link and each channel's unix connection to aether. Host ->
 * aether bytes are queued per channel and written as aether takes them (the link is read
 * on; CREDIT for what was written), aether -> host reads stop at the host's credit.
 * virtio-serial reads return EOF while no host end is connected (before the edge connects,
 * after it restarts, across a snapshot restore): then the channels are dropped and the
 * wait is for the SIGIO the virtio console driver sends when the host end connects.
 * Without a virtio port but with a vsock device (Firecracker) the guest listens on vsock
 * port 1027 and serves one host connection at a time.
 *
 * Built with -DVMPORT_CLI it is a program: without arguments the multiplexer above, forever;
 * for the conformance tests (tests/unit) it serves one link on an inherited fd (--link-fd N)
 * or the connections of an inherited listening socket (--listen-fd N), connecting channels
 * to --target PATH, the identity's files in --etc DIR (run it in a UTS namespace of its own:
 * it sets the hostname).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

enum { OPEN = 1, DATA, CLOSE, HELLO, READY, CREDIT };
#define HDR 9
#define MAX_PAYLOAD (1u << 20)
#define CHUNK 65536
#define WINDOW (256 * 1024) /* the most unacknowledged DATA bytes per channel we take */
#define RBUF (HDR + MAX_PAYLOAD + CHUNK)
#define VSOCK_PORT 1027
#define PORT_NAME "dsec.agent"
#define PORTS_DIR "/sys/class/virtio-ports"
#define VSOCK_DRIVER "/sys/bus/virtio/drivers/vmw_vsock_virtio_transport"

struct piece { /* bytes from the host not yet written to aether */
    struct piece *next;
    uint32_t len, off;
    char data[];
};

struct chan {
    uint32_t id;
    uint64_t serial; /* unique for this process: a pollfd result finds its channel */
    int fd;
    int closing;    /* the host closed it: end it once the queue is written */
    int64_t credit; /* DATA bytes the host still takes (with flow control) */
    struct piece *head, *tail;
};

static struct chan **chans;
static int nchans, capchans;
static uint64_t serials;
static int link_fd = -1, link_err, window;
static const char *target = "/.dsec/run/aether.sock";
static const char *etc = "/etc"; /* where hostname, hosts and machine-id are (tests: a dir) */
static char *rbuf;
static size_t rlen;
static char obuf[HDR + CHUNK];

/* --- frames ------------------------------------------------------------------------- */

static void oom(void) {
    dprintf(2, "vmport: out of memory\n");
    _exit(1); /* vminit starts it again */
}

static void put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24, p[1] = v >> 16, p[2] = v >> 8, p[3] = v;
}

static uint32_t get32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* A frame whose payload is already at obuf + HDR (one write: one virtqueue buffer). */
static void send_obuf(int kind, uint32_t id, uint32_t n) {
    if (link_err)
        return;
    unsigned char *h = (unsigned char *)obuf;
    h[0] = kind;
    put32(h + 1, id);
    put32(h + 5, n);
    size_t done = 0, len = HDR + n;
    while (done < len) {
        ssize_t w = write(link_fd, obuf + done, len - done);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            link_err = errno; /* serve_link returns: the link is reopened */
            return;
        }
        done += w;
    }
}

static void send_frame(int kind, uint32_t id, const void *payload, uint32_t n) {
    memcpy(obuf + HDR, payload, n);
    send_obuf(kind, id, n);
}

/* --- channels ----------------------------------------------------------------------- */

static struct chan *find(uint32_t id) {
    for (int i = 0; i < nchans; i++)
        if (chans[i]->id == id)
            return chans[i];
    return NULL;
}

static struct chan *by_serial(uint64_t serial) {
    for (int i = 0; i < nchans; i++)
        if (chans[i]->serial == serial)
            return chans[i];
    return NULL;
}

/* Close channel c (its connection to aether too); CLOSE to the host when `tell`. */
static void end_chan(struct chan *c, int tell) {
    for (int i = 0; i < nchans; i++)
        if (chans[i] == c) {
            chans[i] = chans[--nchans];
            break;
        }
    if (tell)
        send_frame(CLOSE, c->id, "", 0);
    shutdown(c->fd, SHUT_RDWR);
    close(c->fd);
    while (c->head) {
        struct piece *q = c->head;
        c->head = q->next;
        free(q);
    }
    free(c);
}

static void drop_all(void) {
    while (nchans > 0)
        end_chan(chans[0], 0);
}

static void open_chan(uint32_t id) {
    struct chan *old = find(id);
    if (old)
        end_chan(old, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", target);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0)
            close(fd);
        send_frame(CLOSE, id, "", 0);
        return;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    if (nchans == capchans) {
        capchans = capchans * 2 + 16;
        chans = realloc(chans, capchans * sizeof *chans);
    }
    struct chan *c = calloc(1, sizeof *c);
    if (!c || !chans)
        oom();
    c->id = id;
    c->serial = ++serials;
    c->fd = fd;
    c->credit = window;
    chans[nchans++] = c;
}

/* host -> aether: write what is queued as far as aether takes it. 0: the channel ended. */
static int flush(struct chan *c) {
    uint32_t written = 0;
    while (c->head) {
        struct piece *q = c->head;
        ssize_t w = send(c->fd, q->data + q->off, q->len - q->off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            end_chan(c, 1);
            return 0;
        }
        q->off += w;
        written += w;
        if (q->off == q->len) {
            c->head = q->next;
            if (!c->head)
                c->tail = NULL;
            free(q);
        }
    }
    if (written && window) {
        unsigned char n[4];
        put32(n, written);
        send_frame(CREDIT, c->id, n, 4);
    }
    if (!c->head && c->closing) {
        end_chan(c, 0); /* all the host sent is written: close, as the host did */
        return 0;
    }
    return 1;
}

/* aether -> host: one read of up to a chunk. With flow control it is polled only while
 * the host's credit covers a whole chunk (reading just what little credit is left would
 * make small frames, small credits back, and smaller frames from then on). */
static void pump(struct chan *c) {
    if (window && c->credit < CHUNK)
        return;
    ssize_t n = recv(c->fd, obuf + HDR, CHUNK, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (n <= 0) {
        end_chan(c, 1);
        return;
    }
    c->credit -= n;
    send_obuf(DATA, c->id, n);
}

/* --- identity (HELLO) --------------------------------------------------------------- */

struct ident {
    char host[256], mid[256], seed[1024];
    double time;
    int has_time;
    long long window;
};

static const char *ws(const char *p) {
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

static size_t utf8(unsigned v, char *out) {
    if (v < 0x80)
        return out[0] = v, 1;
    if (v < 0x800)
        return out[0] = 0xC0 | v >> 6, out[1] = 0x80 | (v & 63), 2;
    return out[0] = 0xE0 | v >> 12, out[1] = 0x80 | (v >> 6 & 63), out[2] = 0x80 | (v & 63), 3;
}

/* The JSON string after its opening quote at p, into out (cap bytes; "" when it does not
 * fit; out NULL: skipped). Returns the end of the string, NULL when it is malformed. */
static const char *jstring(const char *p, char *out, size_t cap) {
    size_t n = 0;
    int fits = 1;
    while (*p != '"') {
        char b[4];
        size_t k = 1;
        if (*p == 0 || (unsigned char)*p < 0x20)
            return NULL;
        if (*p != '\\') {
            b[0] = *p++;
        } else {
            char x = p[1];
            p += 2;
            switch (x) {
            case 'n': b[0] = '\n'; break;
            case 't': b[0] = '\t'; break;
            case 'r': b[0] = '\r'; break;
            case 'b': b[0] = '\b'; break;
            case 'f': b[0] = '\f'; break;
            case '"': case '\\': case '/': b[0] = x; break;
            case 'u': {
                unsigned v = 0;
                for (int i = 0; i < 4; i++, p++) {
                    char h = *p;
                    int d = h >= '0' && h <= '9' ? h - '0'
                            : h >= 'a' && h <= 'f' ? h - 'a' + 10
                            : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                    if (d < 0)
                        return NULL;
                    v = v << 4 | d;
                }
                k = utf8(v, b);
                break;
            }
            default:
                return NULL;
            }
        }
        if (out && fits && n + k < cap) {
            memcpy(out + n, b, k);
            n += k;
        } else {
            fits = 0;
        }
    }
    if (out)
        out[fits ? n : 0] = 0;
    return p + 1;
}

/* Past the JSON value at p (any kind), NULL when it is malformed. */
static const char *jskip(const char *p) {
    if (*p == '"')
        return jstring(p + 1, NULL, 0);
    if (*p == '{' || *p == '[') {
        int depth = 0;
        do {
            if (*p == 0)
                return NULL;
            if (*p == '"') {
                if (!(p = jstring(p + 1, NULL, 0)))
                    return NULL;
                continue;
            }
            depth += (*p == '{' || *p == '[') - (*p == '}' || *p == ']');
            p++;
        } while (depth > 0);
        return p;
    }
    const char *s = p;
    while (*p && !strchr(",}] \t\r\n", *p))
        p++;
    return p > s ? p : NULL;
}

/* The top-level object of a HELLO payload (NUL-terminated): 0, or -1 when malformed. */
static int parse_hello(const char *p, struct ident *id) {
    memset(id, 0, sizeof *id);
    p = ws(p);
    if (*p++ != '{')
        return -1;
    p = ws(p);
    if (*p == '}')
        return 0;
    for (;;) {
        char key[16];
        if (*p != '"' || !(p = jstring(p + 1, key, sizeof key)))
            return -1;
        p = ws(p);
        if (*p++ != ':')
            return -1;
        p = ws(p);
        const char *end;
        if (*p == '"') {
            char *dst = !strcmp(key, "hostname")     ? id->host
                        : !strcmp(key, "machine_id") ? id->mid
                        : !strcmp(key, "seed")       ? id->seed
                                                     : NULL;
            size_t cap = dst == id->seed ? sizeof id->seed : sizeof id->host;
            end = jstring(p + 1, dst, cap);
        } else if (!(end = jskip(p))) {
            return -1;
        } else if (*p == '-' || (*p >= '0' && *p <= '9')) {
            char num[64];
            size_t n = end - p < 63 ? (size_t)(end - p) : 63;
            memcpy(num, p, n);
            num[n] = 0;
            if (!strcmp(key, "time")) {
                id->time = strtod(num, NULL);
                id->has_time = 1;
            } else if (!strcmp(key, "window")) {
                id->window = strpbrk(num, ".eE") ? 0 : strtoll(num, NULL, 10);
            }
        } else if (!strcmp(key, "window")) {
            id->window = 0; /* not a number */
        }
        if (!end)
            return -1;
        p = ws(end);
        if (*p == '}')
            return 0;
        if (*p++ != ',')
            return -1;
        p = ws(p);
    }
}

static char *read_all(const char *path, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    ssize_t r;
    while (buf && (r = read(fd, buf + n, cap - n)) > 0) {
        n += r;
        if (n == cap)
            buf = realloc(buf, cap *= 2);
    }
    close(fd);
    *len = n;
    return buf;
}

static void write_all(const char *path, const char *data, size_t len) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    while (len > 0) {
        ssize_t w = write(fd, data, len);
        if (w <= 0)
            break;
        data += w, len -= w;
    }
    close(fd);
}

/* /etc/hosts without its 127.0.1.1 lines, then "127.0.1.1\t<name>". */
static void rewrite_hosts(const char *name) {
    char path[300];
    size_t len;
    snprintf(path, sizeof path, "%s/hosts", etc);
    char *old = read_all(path, &len);
    if (!old)
        return;
    char *out = malloc(len + strlen(name) + 16);
    size_t n = 0;
    for (size_t i = 0; out && i < len;) {
        size_t j = i;
        while (j < len && old[j] != '\n' && old[j] != '\r')
            j++;
        if (j - i < 9 || memcmp(old + i, "127.0.1.1", 9) != 0) {
            memcpy(out + n, old + i, j - i);
            n += j - i;
            out[n++] = '\n';
        }
        i = j + (j + 1 < len && old[j] == '\r' && old[j + 1] == '\n' ? 2 : 1);
    }
    if (out) {
        n += sprintf(out + n, "127.0.1.1\t%s\n", name);
        write_all(path, out, n);
    }
    free(out);
    free(old);
}

/* Hostname, machine id, the host's clock and an RNG seed (a fork child's own identity). */
static void apply_identity(const struct ident *id) {
    struct utsname u;
    char path[300], line[300];
    if (id->host[0] && (uname(&u) != 0 || strcmp(u.nodename, id->host) != 0)) {
        sethostname(id->host, strlen(id->host));
        snprintf(path, sizeof path, "%s/hostname", etc);
        write_all(path, line, snprintf(line, sizeof line, "%s\n", id->host));
        rewrite_hosts(id->host);
    }
    if (id->mid[0]) {
        snprintf(path, sizeof path, "%s/machine-id", etc);
        write_all(path, line, snprintf(line, sizeof line, "%s\n", id->mid));
    }
    struct timespec now;
    if (id->has_time && clock_gettime(CLOCK_REALTIME, &now) == 0) {
        double d = now.tv_sec + now.tv_nsec / 1e9 - id->time;
        if (d > 0.5 || d < -0.5) {
            struct timespec t = {.tv_sec = (time_t)id->time};
            t.tv_nsec = (long)((id->time - (double)t.tv_sec) * 1e9);
            clock_settime(CLOCK_REALTIME, &t);
        }
    }
    if (id->seed[0])
        write_all("/dev/urandom", id->seed, strlen(id->seed));
}

static void hello(const char *payload, uint32_t n) {
    drop_all();
    window = 0;
    if (n > 0) {
        char *s = malloc(n + 1);
        struct ident id;
        if (s) {
            memcpy(s, payload, n);
            s[n] = 0;
            if (parse_hello(s, &id) == 0) {
                apply_identity(&id);
                if (id.window >= CHUNK)
                    window = id.window < WINDOW ? (int)id.window : WINDOW;
            } else {
                dprintf(2, "vmport: HELLO is not a JSON object; identity not applied\n");
            }
            free(s);
        }
    }
    char ready[32];
    int len = window ? snprintf(ready, sizeof ready, "{\"window\": %d}", window) : 0;
    send_frame(READY, 0, ready, len);
}

/* --- the link ----------------------------------------------------------------------- */

static void handle(int kind, uint32_t id, const char *p, uint32_t n) {
    struct chan *c = kind == HELLO || kind == OPEN ? NULL : find(id);
    switch (kind) {
    case HELLO:
        hello(p, n);
        break;
    case OPEN:
        open_chan(id);
        break;
    case DATA: {
        if (!c || c->closing || n == 0)
            break;
        struct piece *q = malloc(sizeof *q + n);
        if (!q)
            oom();
        q->next = NULL, q->len = n, q->off = 0;
        memcpy(q->data, p, n);
        if (c->tail)
            c->tail->next = q;
        else
            c->head = q;
        c->tail = q;
        flush(c);
        break;
    }
    case CREDIT:
        if (c && n == 4)
            c->credit += get32((const unsigned char *)p);
        break;
    case CLOSE:
        if (c && window && c->head)
            c->closing = 1; /* after what is queued for aether */
        else if (c)
            end_chan(c, 0);
        break;
    }
}

/* Read frames from fd until it fails (-1) or, without retry, until EOF (0). On EOF with
 * retry the channels are dropped and the wait is for SIGIO (when `sigio`) or 20 ms. */
static int serve_link(int fd, int retry, int sigio) {
    static struct pollfd *pfds;
    static uint64_t *serial_of;
    static int cap;
    link_fd = fd, link_err = 0, rlen = 0, window = 0;
    for (;;) {
        if (cap < nchans + 1) {
            cap = (nchans + 1) * 2;
            pfds = realloc(pfds, cap * sizeof *pfds);
            serial_of = realloc(serial_of, cap * sizeof *serial_of);
            if (!pfds || !serial_of)
                oom();
        }
        int np = 1;
        pfds[0] = (struct pollfd){.fd = fd, .events = POLLIN};
        for (int i = 0; i < nchans; i++) {
            struct chan *c = chans[i];
            short ev = (c->head ? POLLOUT : 0) | (!window || c->credit >= CHUNK ? POLLIN : 0);
            if (ev) { /* a channel waiting for credit is not polled (its hangup would spin) */
                serial_of[np] = c->serial;
                pfds[np++] = (struct pollfd){.fd = c->fd, .events = ev};
            }
        }
        if (poll(pfds, np, -1) < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        for (int i = 1; i < np && !link_err; i++) {
            struct chan *c = pfds[i].revents ? by_serial(serial_of[i]) : NULL;
            if (c && c->head && (pfds[i].revents & (POLLOUT | POLLERR | POLLHUP)) && !flush(c))
                continue;
            if (c && (pfds[i].events & POLLIN) && (pfds[i].revents & (POLLIN | POLLERR | POLLHUP)))
                pump(c);
        }
        if (link_err) {
            dprintf(2, "vmport: link write: %s\n", strerror(link_err));
            return -1;
        }
        if (!pfds[0].revents)
            continue;
        ssize_t n = read(fd, rbuf + rlen, RBUF - rlen);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            dprintf(2, "vmport: link read: %s\n", strerror(errno));
            return -1;
        }
        if (n == 0) { /* the host end is not connected (yet, or any more) */
            drop_all();
            rlen = 0;
            if (!retry)
                return 0;
            if (sigio) {
                sigset_t s;
                sigemptyset(&s);
                sigaddset(&s, SIGIO);
                struct timespec t = {0, 500 * 1000 * 1000};
                sigtimedwait(&s, NULL, &t); /* a signal left from earlier data: one more EOF */
            } else {
                usleep(20 * 1000);
            }
            continue;
        }
        rlen += n;
        size_t off = 0;
        while (rlen - off >= HDR) {
            const unsigned char *h = (const unsigned char *)rbuf + off;
            uint32_t len = get32(h + 5);
            if (h[0] < OPEN || h[0] > CREDIT || len > MAX_PAYLOAD) {
                dprintf(2, "vmport: bad frame: type %d, length %u\n", h[0], len);
                return -1;
            }
            if (rlen - off < HDR + len)
                break;
            handle(h[0], get32(h + 1), rbuf + off + HDR, len);
            off += HDR + len;
            if (link_err) {
                dprintf(2, "vmport: link write: %s\n", strerror(link_err));
                return -1;
            }
        }
        memmove(rbuf, rbuf + off, rlen - off);
        rlen -= off;
    }
}

/* One link at a time from a listening socket (vsock: the host connects, and again after an
 * edge restart or a snapshot restore reset the connection). Returns when accept fails. */
static void serve_listener(int srv) {
    for (;;) {
        int fd = accept4(srv, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        serve_link(fd, 0, 0);
        drop_all();
        close(fd);
    }
}

static int find_port(char *dev, size_t cap) {
    DIR *d = opendir(PORTS_DIR);
    struct dirent *e;
    int found = 0;
    while (d && !found && (e = readdir(d))) {
        char path[512], name[64];
        snprintf(path, sizeof path, PORTS_DIR "/%s/name", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, name, sizeof name - 1);
        close(fd);
        while (n > 0 && (name[n - 1] == '\n' || name[n - 1] == ' ' || name[n - 1] == 0))
            n--;
        if (n == (ssize_t)strlen(PORT_NAME) && memcmp(name, PORT_NAME, n) == 0) {
            snprintf(dev, cap, "/dev/%s", e->d_name);
            found = 1;
        }
    }
    if (d)
        closedir(d);
    return found;
}

static int vsock_present(void) {
    DIR *d = opendir(VSOCK_DRIVER);
    struct dirent *e;
    int found = 0;
    while (d && !found && (e = readdir(d)))
        found = strncmp(e->d_name, "virtio", 6) == 0;
    if (d)
        closedir(d);
    return found;
}

static void setup(void) {
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGIO);
    sigprocmask(SIG_BLOCK, &s, NULL); /* taken by sigtimedwait, never delivered */
    signal(SIGPIPE, SIG_IGN);
    if (!(rbuf = malloc(RBUF)))
        oom();
}

/* The guest's multiplexer: the virtio port named dsec.agent, else vsock; forever. */
int vmport_main(void) {
    setup();
    for (;;) {
        char dev[300];
        if (!find_port(dev, sizeof dev)) {
            if (vsock_present()) {
                int srv = socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0);
                struct sockaddr_vm a = {
                    .svm_family = AF_VSOCK, .svm_cid = VMADDR_CID_ANY, .svm_port = VSOCK_PORT};
                if (srv >= 0 && bind(srv, (struct sockaddr *)&a, sizeof a) == 0 &&
                    listen(srv, 1) == 0)
                    serve_listener(srv);
                if (srv >= 0)
                    close(srv);
            }
            usleep(100 * 1000);
            continue;
        }
        int fd = open(dev, O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            usleep(100 * 1000);
            continue;
        }
        /* the driver signals the fd's owner when the host end (dis)connects or sends */
        int sigio = fcntl(fd, F_SETOWN, getpid()) == 0 &&
                    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_ASYNC) == 0;
        serve_link(fd, 1, sigio);
        drop_all();
        close(fd);
        usleep(50 * 1000);
    }
}

#ifdef VMPORT_CLI
int main(int argc, char **argv) {
    int link = -1, listener = -1;
    if (argc == 1)
        return vmport_main();
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--link-fd"))
            link = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--listen-fd"))
            listener = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--target"))
            target = argv[i + 1];
        else if (!strcmp(argv[i], "--etc"))
            etc = argv[i + 1];
    }
    if ((link < 0) == (listener < 0)) {
        dprintf(2, "usage: vmport [(--link-fd N | --listen-fd N) [--target PATH] [--etc DIR]]\n");
        return 2;
    }
    setup();
    if (listener >= 0) {
        serve_listener(listener);
        return 0;
    }
    int rc = serve_link(link, 0, 0);
    drop_all();
    return rc < 0 ? 1 : 0;
}
#endif
