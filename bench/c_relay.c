/* The floor for bench/router_http.py: a relay with no Python in it.

   c_relay PORT WORKER_PORT: listens on 127.0.0.1:PORT; each client connection gets its own
   connection to 127.0.0.1:WORKER_PORT and bytes are copied both ways as they arrive, parsing
   nothing. One thread, epoll, level-triggered, one read per readiness, TCP_NODELAY as uvloop sets. Per relayed request it
   makes the syscalls any relay must (read the request, write it on, read the response, write it
   back, plus the epoll waits), so its CPU per request is what the kernel's loopback TCP costs a
   hop: on loopback the sender's CPU time includes the receiver's TCP processing.

   Enough for the benchmark's traffic only: writes block until done (small messages into large
   loopback buffers), and a peer's close closes the pair. */

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_FDS 65536

static int peer_of[MAX_FDS]; /* the other end of each relayed connection, -1 when closed */

static struct sockaddr_in loopback(int port) {
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((unsigned short)port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
}

static void no_delay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int write_all(int fd, const char *data, ssize_t size) {
    while (size > 0) {
        ssize_t sent = write(fd, data, (size_t)size);
        if (sent < 0 && errno == EINTR) continue;
        if (sent <= 0) return -1;
        data += sent;
        size -= sent;
    }
    return 0;
}

static void watch(int epoll_fd, int fd) {
    struct epoll_event event = {.events = EPOLLIN, .data.fd = fd};
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &event);
}

static void close_pair(int fd) {
    int peer = peer_of[fd];
    peer_of[fd] = peer_of[peer] = -1; /* the peer may still have an event in this batch */
    close(fd); /* closing removes it from the epoll set */
    close(peer);
}

/* A new client: connect its worker connection and watch both. */
static void accept_client(int epoll_fd, int listener, int worker_port) {
    int client = accept(listener, NULL, NULL);
    if (client < 0) return;
    int upstream = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in worker = loopback(worker_port);
    if (upstream < 0 || client >= MAX_FDS || upstream >= MAX_FDS ||
        connect(upstream, (struct sockaddr *)&worker, sizeof worker) < 0) {
        close(client);
        if (upstream >= 0) close(upstream);
        return;
    }
    no_delay(client);
    no_delay(upstream);
    peer_of[client] = upstream;
    peer_of[upstream] = client;
    watch(epoll_fd, client);
    watch(epoll_fd, upstream);
}

static void relay(int fd) {
    static char buffer[1 << 16];
    if (peer_of[fd] < 0) return;
    /* MSG_DONTWAIT: a stale readiness (an fd closed and reused within one batch) must not block */
    ssize_t got = recv(fd, buffer, sizeof buffer, MSG_DONTWAIT);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (got <= 0 || write_all(peer_of[fd], buffer, got) < 0) close_pair(fd);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PORT WORKER_PORT\n", argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int worker_port = atoi(argv[2]);
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = loopback(atoi(argv[1]));
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(listener, 128) < 0) {
        perror("c_relay: listen");
        return 1;
    }
    for (int fd = 0; fd < MAX_FDS; fd++) peer_of[fd] = -1;
    int epoll_fd = epoll_create1(0);
    watch(epoll_fd, listener);
    struct epoll_event events[64];
    for (;;) {
        int ready = epoll_wait(epoll_fd, events, 64, -1);
        for (int i = 0; i < ready; i++) {
            int fd = events[i].data.fd;
            if (fd == listener) accept_client(epoll_fd, listener, worker_port);
            else relay(fd);
        }
    }
}
