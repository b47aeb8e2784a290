/* `actorserve router`'s compiled data plane: api/router/relay.py's HTTP/1.1 relay in C, on a thread of
 * its own (api/router/native_plane.py starts it).
 *
 * One epoll loop. Clients' generation requests (POST /generate, /v1/completions,
 * /v1/chat/completions) go to the worker route.c picks; every other request goes to the Python
 * router's private listener (the "control plane": health, server info, broadcasts), which answers
 * it as it does without this file. Worker health is the control plane's: it sends "down <worker>
 * <503 body>" and "up <worker>" lines on the control socket, and is told "failed <worker> <why>"
 * when a request's connection to a worker fails. With an API key, every request but /health is
 * checked here first (in constant time), as api/router/http_router.py checks it. Framing as in api/router/relay.py: requests go to workers
 * with a content-length; a response keeps the worker's content-length, or is sent chunked (one
 * chunk per piece received) so that an error event can always be appended at a chunk boundary.
 *
 * Ownership: a client owns its current exchange; an exchange owns its upstream connection while
 * it is in flight; idle upstream connections sit in their worker's pool. Nothing here blocks. */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "route.h"

#define MAX_HEAD (64 * 1024)
#define MAX_HEADERS 100
#define MAX_KEY 4096
#define CLIENT_OUT_HIGH (1 << 20)  /* stop reading the worker while the client has this much unsent */
#define UPSTREAM_IDLE_S 30.0       /* below aiohttp's keep-alive (75 s), as in api/router/relay.py */
#define READ_SIZE 16384
#define READ_ROUND (256 * 1024)
#define ACCEPT_PAUSE_S 0.1

struct relay_config {
    int listen_fd;  /* bound and listening; the caller closes it */
    int control_fd; /* one end of a socketpair: EOF stops the loop */
    int num_workers;
    const char *const *hosts; /* worker i at hosts[i]:ports[i]; the control plane at index num_workers */
    const int *ports;
    route_router *router; /* the caller's; read by it only for load figures */
    int connect_timeout_ms;
    int64_t max_body;
    const char *api_key; /* NULL: clients need none */
    size_t api_key_len;
    const char *worker_credentials; /* NULL, or "authorization: Bearer <key>\r\n": sent to workers instead of the client's */
};

/* ---- byte buffers ---------------------------------------------------------------------------- */
typedef struct {
    char *data;
    size_t start, end, cap; /* unread bytes are data[start:end] */
} buf;

static size_t buf_len(const buf *b) { return b->end - b->start; }
static char *buf_at(const buf *b) { return b->data + b->start; }

static int buf_reserve(buf *b, size_t extra) {
    if (b->cap - b->end >= extra) return 0;
    if (b->start > 0) { /* slide unread bytes to the front before growing */
        memmove(b->data, b->data + b->start, b->end - b->start);
        b->end -= b->start;
        b->start = 0;
        if (b->cap - b->end >= extra) return 0;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap - b->end < extra) cap *= 2;
    char *data = realloc(b->data, cap);
    if (data == NULL) return -1;
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_add(buf *b, const void *data, size_t len) {
    if (len == 0) return 0; /* either side may be an empty buffer's NULL, which memcpy may not get */
    if (buf_reserve(b, len) != 0) return -1;
    memcpy(b->data + b->end, data, len);
    b->end += len;
    return 0;
}

/* A decimal or hexadecimal number: what printf would write, without its cost on the hot path. */
static int buf_number(buf *b, uint64_t n, unsigned base) {
    char digits[24], *p = digits + sizeof digits;
    do {
        *--p = "0123456789abcdef"[n % base];
        n /= base;
    } while (n > 0);
    return buf_add(b, p, (size_t)(digits + sizeof digits - p));
}

static int buf_printf(buf *b, const char *format, ...) {
    va_list args;
    for (int attempt = 0; attempt < 2; attempt++) {
        va_start(args, format);
        int n = vsnprintf(b->data ? b->data + b->end : NULL, b->cap - b->end, format, args);
        va_end(args);
        if (n < 0) return -1;
        if ((size_t)n < b->cap - b->end) {
            b->end += (size_t)n;
            return 0;
        }
        if (buf_reserve(b, (size_t)n + 1) != 0) return -1;
    }
    return -1;
}

#define ADD_TEXT(b, literal) buf_add((b), (literal), sizeof(literal) - 1)

static void buf_consume(buf *b, size_t n) {
    b->start += n;
    if (b->start == b->end) b->start = b->end = 0;
}

static void buf_free(buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* ---- connections ----------------------------------------------------------------------------- */
enum kind { LISTENER, CONTROL, CLIENT, UPSTREAM };

typedef struct conn { /* the head of each kind's struct: what epoll hands back */
    enum kind kind;
    int fd;             /* -1 once closed: events still queued for it are skipped */
    struct conn *retired; /* freed after the events of this round (one may still name it) */
    uint32_t events; /* registered with epoll */
    buf in, out;
} conn;

typedef struct exchange exchange;
typedef struct upstream upstream;

typedef struct client {
    conn c;
    exchange *exchange; /* the request being answered; the next one waits in `in` */
    int closing;        /* close once `out` is sent */
    int continued;      /* "100 Continue" sent for the request being read */
    int starting;       /* client_next is on the stack */
    struct client *prev, *next;
} client;

struct exchange {
    int worker; /* num_workers: the control plane */
    client *client;
    upstream *upstream;
    int64_t prompt_bytes; /* its load on the router, returned when it ends */
    int keep_alive;       /* the client's */
    int head_sent, chunked, no_body;
    int retried;         /* sent again on a fresh connection once (retry_on_fresh) */
    buf request;         /* the bytes the worker gets, kept for that retry */
    exchange *prev, *next; /* its worker's requests in flight */
};

enum phase { HEAD, BODY_LENGTH, BODY_CHUNKED, BODY_TO_CLOSE };
enum chunk_state { CHUNK_SIZE, CHUNK_DATA, CHUNK_DATA_END, CHUNK_TRAILER };

typedef struct {
    enum chunk_state state;
    uint64_t remaining;
} dechunker;

struct upstream {
    conn c;
    int worker;
    int connecting;
    int reused;         /* taken from the idle pool */
    double deadline;   /* of the connect */
    double idle_since;
    exchange *exchange;
    enum phase phase;
    uint64_t remaining; /* BODY_LENGTH */
    dechunker chunks;
    int reusable;
    upstream *prev, *next; /* its worker's idle connections, or the connecting ones */
};

typedef struct {
    struct sockaddr_storage address;
    socklen_t address_len;
    char *host_header; /* and the router's own credentials, for a worker */
    int resolved;
    upstream *idle;
    exchange *in_flight;
} worker;

typedef struct {
    const struct relay_config *config;
    int epoll_fd;
    conn listener, control;
    worker *workers; /* num_workers + 1: the control plane last */
    client *clients;
    upstream *connecting;
    conn *retired;
    double accept_resumes; /* 0, or when to listen again after running out of descriptors */
    int stopping;
} relay;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int watch(relay *r, conn *c, uint32_t events) {
    if (c->events == events) return 0;
    struct epoll_event event = {.events = events, .data.ptr = c};
    int op = c->events == 0 ? EPOLL_CTL_ADD : (events == 0 ? EPOLL_CTL_DEL : EPOLL_CTL_MOD);
    if (epoll_ctl(r->epoll_fd, op, c->fd, &event) != 0) return -1;
    c->events = events;
    return 0;
}

/* Send what `out` holds; returns -1 when the peer is gone. EPOLLOUT is asked for while bytes remain. */
static int conn_flush(relay *r, conn *c) {
    while (buf_len(&c->out) > 0) {
        ssize_t n = send(c->fd, buf_at(&c->out), buf_len(&c->out), MSG_NOSIGNAL);
        if (n > 0) {
            buf_consume(&c->out, (size_t)n);
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return watch(r, c, c->events | EPOLLOUT);
        } else {
            return -1;
        }
    }
    return watch(r, c, c->events & ~(uint32_t)EPOLLOUT);
}

/* Read what the socket has into `in`: 1 if bytes came (an EOF behind them is seen on the next
 * call: epoll reports it again), 0 on EOF, -1 on error, 2 if nothing was there. */
static int conn_read(conn *c) {
    int got = 2;
    /* At most READ_ROUND per call: a worker far ahead of a slow client must not fill memory before
     * the client's backlog pauses it; level-triggered epoll reports the rest. */
    for (size_t total = 0; total < READ_ROUND;) {
        if (buf_reserve(&c->in, READ_SIZE) != 0) return -1;
        size_t space = c->in.cap - c->in.end;
        ssize_t n = recv(c->fd, c->in.data + c->in.end, space, 0);
        if (n > 0) {
            c->in.end += (size_t)n;
            total += (size_t)n;
            got = 1;
            if ((size_t)n < space) return got; /* a short read: the socket is drained, no EAGAIN call needed */
        } else if (n == 0) {
            return got == 1 ? 1 : 0;
        } else if (errno == EINTR) {
            continue;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            return got;
        } else {
            return got == 1 ? 1 : -1;
        }
    }
    return got;
}

static void conn_close(relay *r, conn *c) {
    if (c->fd >= 0) {
        if (c->events) epoll_ctl(r->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
    }
    c->fd = -1;
    c->events = 0;
    buf_free(&c->in);
    buf_free(&c->out);
}

/* Close a client's or an upstream's connection and free it once this round of events is over. */
static void conn_retire(relay *r, conn *c) {
    conn_close(r, c);
    c->retired = r->retired;
    r->retired = c;
}

static void free_retired(relay *r) {
    while (r->retired != NULL) {
        conn *c = r->retired;
        r->retired = c->retired;
        free(c);
    }
}

/* ---- error bodies: api/server/openai_schema.py's error_body ------------------------------------------ */
static const char *error_type(int status) {
    switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 500: return "internal_server_error";
    case 503: return "service_unavailable_error";
    default: return status < 500 ? "invalid_request_error" : "internal_server_error";
    }
}

static const char *reason_phrase(int status) {
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 413: return "Request Entity Too Large";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Unknown";
    }
}

static int add_json_string(buf *b, const char *text) {
    if (ADD_TEXT(b, "\"") != 0) return -1;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        int ok = *p == '"' || *p == '\\' ? buf_printf(b, "\\%c", *p)
                 : *p < 0x20             ? buf_printf(b, "\\u%04x", *p)
                                         : buf_add(b, p, 1);
        if (ok != 0) return -1;
    }
    return ADD_TEXT(b, "\"");
}

static int add_error_body(buf *b, int status, const char *message, const char *code) {
    if (ADD_TEXT(b, "{\"error\":{\"message\":") || add_json_string(b, message)) return -1;
    if (buf_printf(b, ",\"type\":\"%s\",\"param\":null,\"code\":", error_type(status))) return -1;
    if (code ? add_json_string(b, code) : ADD_TEXT(b, "null")) return -1;
    return ADD_TEXT(b, "}}");
}

/* A whole response with `body` (JSON) into `out`. */
static int add_response(buf *out, int status, const char *body, size_t body_len, int keep_alive) {
    if (buf_printf(out, "HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n%s\r\n", status,
                   reason_phrase(status), body_len, keep_alive ? "" : "connection: close\r\n"))
        return -1;
    return buf_add(out, body, body_len);
}

/* ---- clients --------------------------------------------------------------------------------- */
static void client_next(relay *r, client *cl);
static void exchange_end(relay *r, exchange *x);
static void upstream_close(relay *r, upstream *u);
static int retry_on_fresh(relay *r, exchange *x);

static void client_close(relay *r, client *cl) {
    if (cl->exchange != NULL) { /* closing the worker's connection is what makes it abort the request */
        exchange *x = cl->exchange;
        if (x->upstream != NULL) upstream_close(r, x->upstream);
        exchange_end(r, x);
    }
    if (cl->prev) cl->prev->next = cl->next; else r->clients = cl->next;
    if (cl->next) cl->next->prev = cl->prev;
    conn_retire(r, &cl->c);
}

/* Send what is queued; a client that cannot be written to is closed. 0 if it is still there. */
static int client_flush(relay *r, client *cl) {
    if (conn_flush(r, &cl->c) != 0 || (cl->closing && buf_len(&cl->c.out) == 0)) {
        client_close(r, cl);
        return -1;
    }
    return 0;
}

/* An error response, then the connection closes (what api/router/relay.py's _refuse does). */
static void client_refuse(relay *r, client *cl, int status, const char *message) {
    buf body = {0};
    if (cl->exchange == NULL && add_error_body(&body, status, message, NULL) == 0)
        add_response(&cl->c.out, status, buf_at(&body), buf_len(&body), 0);
    buf_free(&body);
    cl->closing = 1;
    cl->c.in.start = cl->c.in.end = 0;
    watch(r, &cl->c, cl->c.events & ~(uint32_t)(EPOLLIN | EPOLLRDHUP));
    client_flush(r, cl);
}

/* The response to the current request is written: the next request may go. */
static void client_done(relay *r, client *cl, int keep_alive) {
    cl->exchange = NULL;
    if (!keep_alive) cl->closing = 1;
    if (client_flush(r, cl) != 0 || cl->closing) return;
    if (watch(r, &cl->c, cl->c.events | EPOLLIN | EPOLLRDHUP) != 0) {
        client_close(r, cl);
        return;
    }
    client_next(r, cl);
}

/* ---- HTTP parsing ---------------------------------------------------------------------------- */
typedef struct {
    const char *name, *value;
    size_t name_len, value_len;
} header;

typedef struct {
    const char *first_line;
    size_t first_line_len;
    header headers[MAX_HEADERS];
    int num_headers;
    size_t head_len; /* through the blank line */
} head;

/* Split a complete head ("...\r\n\r\n") into its first line and headers. -1: malformed. */
static int parse_head(const char *data, size_t len, head *h) {
    const char *end = memmem(data, len, "\r\n\r\n", 4);
    if (end == NULL) return 0;
    h->head_len = (size_t)(end - data) + 4;
    const char *line = data, *stop = end + 2;
    const char *eol = memmem(line, (size_t)(stop - line), "\r\n", 2);
    h->first_line = line;
    h->first_line_len = (size_t)(eol - line);
    h->num_headers = 0;
    for (line = eol + 2; line < stop; line = eol + 2) {
        eol = memmem(line, (size_t)(stop - line), "\r\n", 2);
        const char *colon = memchr(line, ':', (size_t)(eol - line));
        if (colon == NULL || colon == line || h->num_headers == MAX_HEADERS) return -1;
        for (const char *p = line; p < colon; p++)
            if (*p == ' ' || *p == '\t' || (unsigned char)*p < 0x21) return -1;
        const char *value = colon + 1, *value_end = eol;
        while (value < value_end && (*value == ' ' || *value == '\t')) value++;
        while (value_end > value && (value_end[-1] == ' ' || value_end[-1] == '\t')) value_end--;
        h->headers[h->num_headers++] = (header){line, value, (size_t)(colon - line), (size_t)(value_end - value)};
    }
    return 1;
}

static int is(const char *text, size_t len, const char *word) {
    return strlen(word) == len && strncasecmp(text, word, len) == 0;
}

static int has_token(const char *text, size_t len, const char *token) { /* in a comma-separated list */
    size_t n = strlen(token);
    for (size_t i = 0; i + n <= len; i++)
        if (strncasecmp(text + i, token, n) == 0 && (i == 0 || text[i - 1] == ',' || text[i - 1] == ' ') &&
            (i + n == len || text[i + n] == ',' || text[i + n] == ' '))
            return 1;
    return 0;
}

#define NAME(text) {text, sizeof(text) - 1}
static const struct {
    const char *text;
    size_t len;
} HOP_HEADERS[] = {NAME("connection"), NAME("keep-alive"), NAME("transfer-encoding"), NAME("content-length"),
                   NAME("host"), NAME("te"), NAME("trailer"), NAME("upgrade"), NAME("proxy-connection"),
                   NAME("expect")};

static int is_hop_header(const header *h) {
    for (size_t i = 0; i < sizeof HOP_HEADERS / sizeof *HOP_HEADERS; i++)
        if (HOP_HEADERS[i].len == h->name_len && strncasecmp(h->name, HOP_HEADERS[i].text, h->name_len) == 0) return 1;
    return 0;
}

static int is_credential_header(const header *h) {
    return is(h->name, h->name_len, "authorization") || is(h->name, h->name_len, "x-api-key");
}

/* The headers that describe the message, not the connection: what a relay passes on (without the
 * client's credentials when the router sends its own). */
static int add_end_to_end_headers(buf *out, const head *h, int drop_credentials) {
    for (int i = 0; i < h->num_headers; i++) {
        const header *k = &h->headers[i];
        if (is_hop_header(k) || (drop_credentials && is_credential_header(k))) continue;
        if (buf_add(out, k->name, k->name_len) || ADD_TEXT(out, ": ") || buf_add(out, k->value, k->value_len) ||
            ADD_TEXT(out, "\r\n"))
            return -1;
    }
    return 0;
}

typedef struct {
    int64_t content_length; /* -1: none */
    int chunked, close, keep_alive_asked, upgrade, expect_continue, bad;
} framing;

static framing read_framing(const head *h) {
    framing f = {.content_length = -1};
    for (int i = 0; i < h->num_headers; i++) {
        const header *x = &h->headers[i];
        if (is(x->name, x->name_len, "content-length")) {
            int64_t n = 0;
            if (x->value_len == 0 || x->value_len > 18) f.bad = 1;
            for (size_t j = 0; j < x->value_len && !f.bad; j++) { /* up to 18 digits: n cannot overflow */
                if (x->value[j] < '0' || x->value[j] > '9') f.bad = 1;
                else n = n * 10 + (x->value[j] - '0');
            }
            if (f.content_length >= 0 && f.content_length != n) f.bad = 1;
            f.content_length = n;
        } else if (is(x->name, x->name_len, "transfer-encoding")) {
            if (is(x->value, x->value_len, "chunked")) f.chunked = 1;
            else f.bad = 1;
        } else if (is(x->name, x->name_len, "connection")) {
            f.close |= has_token(x->value, x->value_len, "close");
            f.keep_alive_asked |= has_token(x->value, x->value_len, "keep-alive");
            f.upgrade |= has_token(x->value, x->value_len, "upgrade");
        } else if (is(x->name, x->name_len, "upgrade")) {
            f.upgrade = 1;
        } else if (is(x->name, x->name_len, "expect")) {
            f.expect_continue = is(x->value, x->value_len, "100-continue");
        }
    }
    if (f.chunked && f.content_length >= 0) f.bad = 1; /* ambiguous framing: a smuggling vector */
    return f;
}

/* Decode chunked bytes from `in`, handing each piece of data to `emit`. 1: the body is complete,
 * 0: more bytes are needed, -1: malformed or `emit` failed. */
static int dechunk(dechunker *d, buf *in, int (*emit)(void *, const char *, size_t), void *context) {
    for (;;) {
        char *data = buf_at(in);
        size_t len = buf_len(in);
        if (len == 0) return 0; /* and memmem may not get an empty buffer's NULL */
        if (d->state == CHUNK_DATA) {
            size_t n = len < d->remaining ? len : (size_t)d->remaining;
            if (emit(context, data, n) != 0) return -1;
            buf_consume(in, n);
            d->remaining -= n;
            if (d->remaining == 0) d->state = CHUNK_DATA_END;
            continue;
        }
        if (d->state == CHUNK_DATA_END) {
            if (len < 2) return 0;
            if (data[0] != '\r' || data[1] != '\n') return -1;
            buf_consume(in, 2);
            d->state = CHUNK_SIZE;
            continue;
        }
        char *eol = memmem(data, len, "\r\n", 2);
        if (eol == NULL) return len > 4096 ? -1 : 0;
        size_t line_len = (size_t)(eol - data);
        if (d->state == CHUNK_TRAILER) {
            buf_consume(in, line_len + 2);
            if (line_len == 0) return 1;
            continue;
        }
        uint64_t size = 0;
        size_t digits = 0;
        for (; digits < line_len && digits < 16; digits++) {
            char c = data[digits];
            int v = c >= '0' && c <= '9' ? c - '0' : (c | 0x20) >= 'a' && (c | 0x20) <= 'f' ? (c | 0x20) - 'a' + 10 : -1;
            if (v < 0) break;
            size = size * 16 + (uint64_t)v;
        }
        if (digits == 0 || (digits < line_len && data[digits] != ';' && data[digits] != ' ')) return -1;
        buf_consume(in, line_len + 2);
        d->remaining = size;
        d->state = size == 0 ? CHUNK_TRAILER : CHUNK_DATA;
    }
}

/* ---- the worker side ------------------------------------------------------------------------- */
static void tell_control(relay *r, const char *format, ...) {
    va_list args;
    char line[1024];
    va_start(args, format);
    int n = vsnprintf(line, sizeof line - 1, format, args);
    va_end(args);
    if (n < 0) return;
    if ((size_t)n > sizeof line - 2) n = (int)sizeof line - 2;
    for (int i = 0; i < n; i++)
        if (line[i] == '\n') line[i] = ' ';
    line[n++] = '\n';
    if (buf_add(&r->control.out, line, (size_t)n) == 0) conn_flush(r, &r->control);
}

static void unlink_upstream(upstream **list, upstream *u) {
    if (u->prev) u->prev->next = u->next; else if (*list == u) *list = u->next;
    if (u->next) u->next->prev = u->prev;
    u->prev = u->next = NULL;
}

static void push_upstream(upstream **list, upstream *u) {
    u->prev = NULL;
    u->next = *list;
    if (*list) (*list)->prev = u;
    *list = u;
}

static void upstream_close(relay *r, upstream *u) {
    worker *w = &r->workers[u->worker];
    if (u->exchange != NULL) u->exchange->upstream = NULL;
    if (u->connecting) unlink_upstream(&r->connecting, u);
    else if (u->exchange == NULL) unlink_upstream(&w->idle, u);
    conn_retire(r, &u->c);
}

/* The exchange is over: its load returns to the router, it leaves its worker's list. */
static void exchange_end(relay *r, exchange *x) {
    worker *w = &r->workers[x->worker];
    if (x->prev) x->prev->next = x->next; else w->in_flight = x->next;
    if (x->next) x->next->prev = x->prev;
    if (x->worker < r->config->num_workers) route_finished(r->config->router, x->worker, x->prompt_bytes);
    if (x->upstream != NULL) x->upstream->exchange = NULL;
    if (x->client != NULL && x->client->exchange == x) x->client->exchange = NULL;
    buf_free(&x->request);
    free(x);
}

/* The worker is lost under `x`: a 503 with `body` if nothing was sent yet, the error `event`
 * ending a chunked stream, or the client's connection closed inside a body of announced length. */
static void exchange_lose(relay *r, exchange *x, const char *body, size_t body_len) {
    client *cl = x->client;
    int keep_alive = x->keep_alive, head_sent = x->head_sent, chunked = x->chunked;
    if (x->upstream != NULL) upstream_close(r, x->upstream);
    exchange_end(r, x);
    if (!head_sent) {
        add_response(&cl->c.out, 503, body, body_len, keep_alive);
    } else if (chunked) {
        size_t event_len = body_len + 6 + 16;
        if (buf_printf(&cl->c.out, "%zx\r\ndata: ", event_len) || buf_add(&cl->c.out, body, body_len) ||
            ADD_TEXT(&cl->c.out, "\n\ndata: [DONE]\n\n\r\n0\r\n\r\n"))
            keep_alive = 0;
    } else {
        keep_alive = 0;
    }
    client_done(r, cl, keep_alive);
}

/* The control plane's own connection failed, or a worker's: the worker is marked down here at
 * once (no new request goes there) and the control plane is told; its "down" line ends the
 * worker's requests in flight with the message it composes. */
static void worker_failed(relay *r, exchange *x, const char *why) {
    if (x->worker == r->config->num_workers) {
        buf body = {0};
        if (add_error_body(&body, 503, "the router's control plane is unavailable", "worker_unavailable") == 0)
            exchange_lose(r, x, buf_at(&body), buf_len(&body));
        buf_free(&body);
        return;
    }
    if (x->upstream != NULL) upstream_close(r, x->upstream);
    route_set_healthy(r->config->router, x->worker, 0);
    tell_control(r, "failed %d %s", x->worker, why);
}

static int emit_chunk(void *context, const char *data, size_t len) {
    exchange *x = context;
    buf *out = &x->client->c.out;
    return buf_number(out, len, 16) || ADD_TEXT(out, "\r\n") || buf_add(out, data, len) || ADD_TEXT(out, "\r\n");
}

static void upstream_release(relay *r, upstream *u) {
    u->exchange = NULL;
    if (!u->reusable || u->c.fd < 0 || buf_len(&u->c.in) > 0) { /* bytes past the response: not trusted */
        upstream_close(r, u);
        return;
    }
    u->idle_since = now_s();
    u->phase = HEAD;
    push_upstream(&r->workers[u->worker].idle, u);
}

static void exchange_complete(relay *r, exchange *x) {
    client *cl = x->client;
    int keep_alive = x->keep_alive;
    if (x->chunked) ADD_TEXT(&cl->c.out, "0\r\n\r\n");
    upstream *u = x->upstream;
    x->upstream = NULL;
    exchange_end(r, x);
    if (u != NULL) upstream_release(r, u);
    client_done(r, cl, keep_alive);
}

/* The response head: passed on without hop-by-hop headers, with the relay's own framing. */
static int response_head(relay *r, upstream *u, exchange *x, const head *h) {
    (void)r;
    const char *line = h->first_line;
    size_t len = h->first_line_len;
    if (len < 12 || strncmp(line, "HTTP/1.", 7) != 0 || line[8] != ' ') return -1;
    int status = 0;
    for (int i = 9; i < 12; i++) {
        if (line[i] < '0' || line[i] > '9') return -1;
        status = status * 10 + (line[i] - '0');
    }
    if (len > 12 && line[12] != ' ') return -1;
    framing f = read_framing(h);
    if (f.bad) return -1;
    if (status < 200) return 0; /* an interim response: the final one follows */
    int http10 = line[7] == '0';
    u->reusable = !f.close && (!http10 || f.keep_alive_asked);
    x->no_body = status == 204 || status == 304;
    x->chunked = !x->no_body && f.content_length < 0;
    buf *out = &x->client->c.out;
    const char *reason = len > 13 ? line + 13 : reason_phrase(status);
    int reason_len = len > 13 ? (int)(len - 13) : (int)strlen(reason);
    if (ADD_TEXT(out, "HTTP/1.1 ") || buf_add(out, line + 9, 3) || ADD_TEXT(out, " ") ||
        buf_add(out, reason, (size_t)reason_len) || ADD_TEXT(out, "\r\n"))
        return -1;
    if (add_end_to_end_headers(out, h, 0)) return -1;
    if (x->chunked ? ADD_TEXT(out, "transfer-encoding: chunked\r\n")
                   : (!x->no_body && (ADD_TEXT(out, "content-length: ") ||
                                      buf_number(out, (uint64_t)f.content_length, 10) || ADD_TEXT(out, "\r\n"))))
        return -1;
    if (!x->keep_alive && ADD_TEXT(out, "connection: close\r\n")) return -1;
    if (ADD_TEXT(out, "\r\n")) return -1;
    x->head_sent = 1;
    if (x->no_body) u->phase = BODY_LENGTH, u->remaining = 0;
    else if (f.chunked) u->phase = BODY_CHUNKED, u->chunks = (dechunker){CHUNK_SIZE, 0};
    else if (f.content_length >= 0) u->phase = BODY_LENGTH, u->remaining = (uint64_t)f.content_length;
    else u->phase = BODY_TO_CLOSE, u->reusable = 0;
    return 1;
}

/* Parse what the worker sent: 1 when the response is complete, 0 for more, -1 malformed. */
static int upstream_parse(relay *r, upstream *u, exchange *x) {
    buf *in = &u->c.in;
    while (u->phase == HEAD) {
        head h;
        int got = parse_head(buf_at(in), buf_len(in), &h);
        if (got == 0) return buf_len(in) > MAX_HEAD ? -1 : 0;
        if (got < 0) return -1;
        got = response_head(r, u, x, &h);
        if (got < 0) return -1;
        buf_consume(in, h.head_len);
    }
    if (u->phase == BODY_CHUNKED) return dechunk(&u->chunks, in, emit_chunk, x);
    size_t n = buf_len(in);
    if (u->phase == BODY_LENGTH && n > u->remaining) return -1; /* bytes past the response */
    if (n > 0 && (x->chunked ? emit_chunk(x, buf_at(in), n) : buf_add(&x->client->c.out, buf_at(in), n))) return -1;
    buf_consume(in, n);
    if (u->phase == BODY_TO_CLOSE) return 0;
    u->remaining -= n;
    return u->remaining == 0;
}

static void upstream_readable(relay *r, upstream *u) {
    int got = conn_read(&u->c);
    exchange *x = u->exchange;
    if (x == NULL) { /* an idle connection: the worker closed it, or sent what nobody asked for */
        if (got != 2) upstream_close(r, u);
        return;
    }
    client *cl = x->client;
    int parsed = got < 0 ? 0 : upstream_parse(r, u, x); /* a reset (got < 0) is a loss, not a malformed response */
    if (parsed == 1) {
        exchange_complete(r, x);
        return;
    }
    if (parsed < 0 || got <= 0) {
        if (parsed >= 0 && got == 0 && u->phase == BODY_TO_CLOSE) {
            exchange_complete(r, x);
            return;
        }
        if (parsed >= 0 && retry_on_fresh(r, x)) return;
        int to_worker = x->worker < r->config->num_workers;
        worker_failed(r, x, parsed < 0 ? "malformed response" : got == 0 ? "connection closed by the worker" : "connection lost");
        if (to_worker && cl->c.fd >= 0) client_flush(r, cl); /* what came so far; the end waits for "down" */
        return;
    }
    if (client_flush(r, cl) != 0) return;
    if (buf_len(&cl->c.out) > CLIENT_OUT_HIGH) watch(r, &u->c, u->c.events & ~(uint32_t)EPOLLIN);
}

static int upstream_send(relay *r, upstream *u) {
    if (conn_flush(r, &u->c) != 0) return -1;
    return watch(r, &u->c, u->c.events | EPOLLIN | EPOLLRDHUP);
}

static void upstream_connected(relay *r, upstream *u) {
    int error = 0;
    socklen_t len = sizeof error;
    getsockopt(u->c.fd, SOL_SOCKET, SO_ERROR, &error, &len);
    unlink_upstream(&r->connecting, u);
    u->connecting = 0;
    exchange *x = u->exchange;
    if (error != 0 || upstream_send(r, u) != 0) {
        char why[256];
        snprintf(why, sizeof why, "cannot connect: %s", strerror(error ? error : errno));
        worker_failed(r, x, why);
    }
}

/* The request as the worker gets it: its own host header, hop-by-hop headers dropped, the body
 * with a content-length. */
static int request_bytes(relay *r, buf *out, int worker_index, const head *h, const char *body, size_t body_len) {
    const char *line = h->first_line, *version = memmem(line, h->first_line_len, " HTTP/1.", 8);
    if (r->workers[worker_index].host_header == NULL) return -1;
    if (buf_add(out, line, (size_t)(version - line)) || ADD_TEXT(out, " HTTP/1.1\r\n")) return -1;
    if (buf_add(out, r->workers[worker_index].host_header, strlen(r->workers[worker_index].host_header))) return -1;
    int own_credentials = worker_index < r->config->num_workers && r->config->worker_credentials != NULL;
    if (add_end_to_end_headers(out, h, own_credentials)) return -1;
    if (ADD_TEXT(out, "content-length: ") || buf_number(out, body_len, 10) || ADD_TEXT(out, "\r\n\r\n")) return -1;
    return buf_add(out, body, body_len);
}

/* An idle connection to the exchange's worker, or a new one (connect under way). */
static upstream *upstream_for(relay *r, exchange *x, int fresh, char *why, size_t why_len) {
    worker *w = &r->workers[x->worker];
    double now = now_s();
    while (w->idle != NULL && !fresh) {
        upstream *u = w->idle;
        unlink_upstream(&w->idle, u);
        if (now - u->idle_since < UPSTREAM_IDLE_S) {
            u->reused = 1;
            return u;
        }
        conn_retire(r, &u->c);
    }
    if (!w->resolved) {
        snprintf(why, why_len, "cannot connect: the worker's host did not resolve");
        return NULL;
    }
    upstream *u = calloc(1, sizeof *u);
    if (u == NULL) {
        snprintf(why, why_len, "out of memory");
        return NULL;
    }
    u->c.kind = UPSTREAM;
    u->worker = x->worker;
    u->c.fd = socket(w->address.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (u->c.fd < 0 || setsockopt(u->c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0 ||
        (connect(u->c.fd, (struct sockaddr *)&w->address, w->address_len) != 0 && errno != EINPROGRESS)) {
        snprintf(why, why_len, "cannot connect: %s", strerror(errno));
        conn_retire(r, &u->c);
        return NULL;
    }
    u->connecting = 1;
    u->deadline = now + r->config->connect_timeout_ms / 1000.0;
    push_upstream(&r->connecting, u);
    return u;
}

/* Send the exchange's request on an idle connection to its worker, or on a new one (`fresh`: new). */
static void exchange_send(relay *r, exchange *x, int fresh) {
    char why[256];
    upstream *u = upstream_for(r, x, fresh, why, sizeof why);
    if (u == NULL) {
        worker_failed(r, x, why);
        return;
    }
    u->exchange = x;
    x->upstream = u;
    u->phase = HEAD;
    if (buf_add(&u->c.out, buf_at(&x->request), buf_len(&x->request)) != 0) {
        worker_failed(r, x, "out of memory");
    } else if (u->connecting) {
        if (watch(r, &u->c, EPOLLOUT) != 0) worker_failed(r, x, "cannot watch the connection");
    } else if (upstream_send(r, u) != 0 && !retry_on_fresh(r, x)) {
        worker_failed(r, x, "connection lost");
    }
}

/* A kept-alive connection that fails before anything comes back may have been closed by the
 * worker as it was reused (its keep-alive ran out at that moment): the request goes once more, on
 * a fresh connection, before the worker is blamed. Generation has no side effects to repeat. */
static int retry_on_fresh(relay *r, exchange *x) {
    upstream *u = x->upstream;
    if (u == NULL || !u->reused || x->retried || x->head_sent || buf_len(&u->c.in) > 0) return 0;
    x->retried = 1;
    upstream_close(r, u);
    exchange_send(r, x, 1);
    return 1;
}

static void exchange_start(relay *r, client *cl, int worker_index, int64_t prompt_bytes, int keep_alive, const head *h,
                           const char *body, size_t body_len) {
    exchange *x = calloc(1, sizeof *x);
    if (x == NULL) {
        client_refuse(r, cl, 500, "the router is out of memory");
        return;
    }
    worker *w = &r->workers[worker_index];
    *x = (exchange){.worker = worker_index, .client = cl, .prompt_bytes = prompt_bytes, .keep_alive = keep_alive};
    x->next = w->in_flight;
    if (w->in_flight) w->in_flight->prev = x;
    w->in_flight = x;
    cl->exchange = x;
    if (worker_index < r->config->num_workers) route_started(r->config->router, worker_index, prompt_bytes);
    if (request_bytes(r, &x->request, worker_index, h, body, body_len) != 0) {
        worker_failed(r, x, "out of memory");
        return;
    }
    exchange_send(r, x, 0);
}

/* ---- requests -------------------------------------------------------------------------------- */
/* An error response to the current request; the connection stays as the client asked. */
static void answer_error(relay *r, client *cl, int status, const char *message, const char *code, int keep_alive) {
    buf body = {0};
    if (add_error_body(&body, status, message, code) == 0) add_response(&cl->c.out, status, buf_at(&body), buf_len(&body), keep_alive);
    buf_free(&body);
    client_done(r, cl, keep_alive);
}

static int is_generation(const char *path, size_t len) {
    return is(path, len, "/generate") || is(path, len, "/v1/completions") || is(path, len, "/v1/chat/completions");
}

static const header *find_header(const head *h, const char *name) {
    for (int i = 0; i < h->num_headers; i++)
        if (is(h->headers[i].name, h->headers[i].name_len, name)) return &h->headers[i];
    return NULL;
}

/* The client sent the router's key, read as api/router/http_router.py's client_key reads it
 * (`authorization: Bearer <key>`, else `x-api-key`). The time taken depends on the key's length
 * only, never on how much of it a client guessed right. */
static int has_key(const relay *r, const head *h) {
    const header *authorization = find_header(h, "authorization"), *x_api_key = find_header(h, "x-api-key");
    const char *given = "";
    size_t given_len = 0;
    if (authorization != NULL && authorization->value_len >= 7 && strncasecmp(authorization->value, "bearer ", 7) == 0) {
        given = authorization->value + 7;
        given_len = authorization->value_len - 7;
    } else if (x_api_key != NULL) {
        given = x_api_key->value;
        given_len = x_api_key->value_len;
    }
    const unsigned char *key = (const unsigned char *)r->config->api_key;
    size_t key_len = r->config->api_key_len;
    unsigned diff = given_len != key_len;
    for (size_t i = 0; i < key_len; i++) diff |= key[i] ^ (i < given_len ? (unsigned char)given[i] : 0u);
    return diff == 0;
}

static void dispatch(relay *r, client *cl, const head *h, const char *body, size_t body_len, int keep_alive) {
    const char *line = h->first_line, *target = memchr(line, ' ', h->first_line_len);
    const char *target_end = memchr(target + 1, ' ', (size_t)(line + h->first_line_len - target - 1));
    const char *path_end = memchr(target + 1, '?', (size_t)(target_end - target - 1));
    size_t path_len = (size_t)((path_end ? path_end : target_end) - target - 1);
    int control = r->config->num_workers;
    if (r->config->api_key != NULL && !is(target + 1, path_len, "/health") && !has_key(r, h)) {
        answer_error(r, cl, 401, "invalid or missing API key (send 'Authorization: Bearer <key>')", "invalid_api_key", keep_alive);
        return;
    }
    if (!(is(line, (size_t)(target - line), "POST") && is_generation(target + 1, path_len))) {
        exchange_start(r, cl, control, 0, keep_alive, h, body, body_len);
        return;
    }
    const uint8_t *prompt;
    size_t prompt_len, key_len = 0;
    uint8_t key[MAX_KEY];
    int has_key = route_fields((const uint8_t *)body, body_len, &prompt, &prompt_len, key, sizeof key, &key_len);
    int chosen = route_choose(r->config->router, prompt, prompt_len, key, key_len, has_key);
    if (chosen < 0) {
        answer_error(r, cl, 503, "no worker is available", "worker_unavailable", keep_alive);
        return;
    }
    exchange_start(r, cl, chosen, (int64_t)prompt_len, keep_alive, h, body, body_len);
}

static int collect_body(void *context, const char *data, size_t len) { return buf_add(context, data, len); }

static void refuse_too_large(relay *r, client *cl) {
    char message[96];
    snprintf(message, sizeof message, "the request body is larger than %lld bytes", (long long)r->config->max_body);
    client_refuse(r, cl, 413, message);
}

/* 1 when the body of `content_length` bytes (-1: none) after the head is all in `in`, else 0. */
static int whole_body(const buf *in, size_t head_len, int64_t content_length, size_t *used) {
    *used = head_len + (content_length < 0 ? 0 : (size_t)content_length);
    return buf_len(in) >= *used;
}

/* A chunked body after the head, decoded into `body`: 1 when it is complete, 0 while more is to
 * come, -1 when it is refused (400, 413). Rare on this path, so decoded from the start each time
 * more arrives. */
static int decode_chunked(relay *r, client *cl, size_t head_len, buf *body, size_t *used) {
    buf *in = &cl->c.in, rest = {0};
    dechunker d = {CHUNK_SIZE, 0};
    int done = buf_add(&rest, buf_at(in) + head_len, buf_len(in) - head_len) != 0 ? -1 : dechunk(&d, &rest, collect_body, body);
    *used = buf_len(in) - buf_len(&rest);
    buf_free(&rest);
    if (done < 0) {
        client_refuse(r, cl, 400, "malformed HTTP request: bad chunked body");
    } else if ((int64_t)buf_len(body) > r->config->max_body) {
        refuse_too_large(r, cl);
        done = -1;
    }
    return done;
}

/* Parse the next request in the client's buffer and start it, if it is all there: 1 if it was. */
static int client_start(relay *r, client *cl) {
    if (cl->exchange != NULL || cl->closing) return 0;
    buf *in = &cl->c.in;
    head h;
    int got = parse_head(buf_at(in), buf_len(in), &h);
    if (got == 0 ? buf_len(in) > MAX_HEAD : h.head_len > MAX_HEAD) { /* a whole head may come in one read */
        client_refuse(r, cl, 431, "the request head is larger than 65536 bytes");
        return 0;
    }
    if (got == 0) return 0;
    const char *line = h.first_line, *sp1 = memchr(line, ' ', h.first_line_len);
    const char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(line + h.first_line_len - sp1 - 1)) : NULL;
    size_t version_len = sp2 ? (size_t)(line + h.first_line_len - sp2 - 1) : 0;
    if (got < 0 || sp1 == NULL || sp2 == NULL || sp1 == line || sp2 == sp1 + 1 || sp1[1] != '/' || version_len != 8 ||
        strncmp(sp2 + 1, "HTTP/1.", 7) != 0 || (sp2[8] != '0' && sp2[8] != '1')) {
        client_refuse(r, cl, 400, "malformed HTTP request: not an HTTP/1.x request head");
        return 0;
    }
    framing f = read_framing(&h);
    if (f.bad) {
        client_refuse(r, cl, 400, "malformed HTTP request: bad content-length or transfer-encoding");
        return 0;
    }
    if (f.upgrade) {
        client_refuse(r, cl, 400, "protocol upgrades are not supported");
        return 0;
    }
    int keep_alive = sp2[8] == '1' ? !f.close : f.keep_alive_asked && !f.close;
    if (f.content_length > r->config->max_body) {
        refuse_too_large(r, cl);
        return 0;
    }
    buf decoded = {0}; /* a chunked body, sent on with a length */
    size_t used = 0;   /* the bytes of `in` the request takes, its head included */
    int ready = f.chunked ? decode_chunked(r, cl, h.head_len, &decoded, &used)
                          : whole_body(in, h.head_len, f.content_length, &used);
    if (ready == 0 && f.expect_continue && !cl->continued) {
        cl->continued = 1;
        ADD_TEXT(&cl->c.out, "HTTP/1.1 100 Continue\r\n\r\n");
        client_flush(r, cl);
    }
    if (ready == 1) {
        cl->continued = 0;
        /* Consumed in place: the bytes stay where they are until the next read, and nothing
         * reads `in` again before this request is built. */
        char *start = buf_at(in);
        in->start += used;
        if (f.chunked) dispatch(r, cl, &h, buf_at(&decoded), buf_len(&decoded), keep_alive);
        else dispatch(r, cl, &h, start + h.head_len, used - h.head_len, keep_alive);
    }
    buf_free(&decoded);
    return ready == 1;
}

/* Start the client's buffered requests in turn. One answered at once (a 503, a refusal) ends in
 * client_done, which calls back here: a loop instead of that recursion keeps the stack flat
 * under thousands of pipelined requests. */
static void client_next(relay *r, client *cl) {
    if (cl->starting) return; /* the loop further up the stack goes on */
    cl->starting = 1;
    while (cl->c.fd >= 0 && client_start(r, cl)) continue;
    cl->starting = 0;
}

static void client_readable(relay *r, client *cl, uint32_t events) {
    int got = conn_read(&cl->c);
    if (got <= 0 || (got == 2 && (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)))) {
        client_close(r, cl); /* the client left: its request, if any, is abandoned */
        return;
    }
    if (buf_len(&cl->c.in) > MAX_HEAD + (size_t)r->config->max_body && cl->exchange != NULL) {
        watch(r, &cl->c, cl->c.events & ~(uint32_t)EPOLLIN); /* pipelining past the limit: wait */
        return;
    }
    if (cl->c.in.start == cl->c.in.end) cl->c.in.start = cl->c.in.end = 0;
    client_next(r, cl);
}

static void accept_clients(relay *r) {
    for (;;) {
        int fd = accept4(r->listener.fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
            /* The listener stays readable while out of descriptors: without a pause this would spin. */
            watch(r, &r->listener, 0);
            r->accept_resumes = now_s() + ACCEPT_PAUSE_S;
        }
        if (fd < 0) return;
        client *cl = calloc(1, sizeof *cl);
        int one = 1;
        if (cl == NULL) {
            close(fd);
            return;
        }
        cl->c.kind = CLIENT;
        cl->c.fd = fd;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        cl->next = r->clients;
        if (r->clients) r->clients->prev = cl;
        r->clients = cl;
        if (watch(r, &cl->c, EPOLLIN | EPOLLRDHUP) != 0) client_close(r, cl);
    }
}

/* ---- the control plane's lines --------------------------------------------------------------- */
static void worker_down(relay *r, int index, const char *body, size_t body_len) {
    worker *w = &r->workers[index];
    route_set_healthy(r->config->router, index, 0);
    while (w->idle != NULL) upstream_close(r, w->idle);
    while (w->in_flight != NULL) exchange_lose(r, w->in_flight, body, body_len);
}

static void control_readable(relay *r) {
    int got = conn_read(&r->control);
    buf *in = &r->control.in;
    char *eol;
    while ((eol = memchr(buf_at(in), '\n', buf_len(in))) != NULL) {
        char *line = buf_at(in);
        size_t len = (size_t)(eol - line);
        *eol = '\0';
        int index = -1, offset = 0;
        if (sscanf(line, "down %d %n", &index, &offset) == 1 && offset > 0 && index >= 0 && index < r->config->num_workers)
            worker_down(r, index, line + offset, len - (size_t)offset);
        else if (sscanf(line, "up %d", &index) == 1 && index >= 0 && index < r->config->num_workers)
            route_set_healthy(r->config->router, index, 1);
        buf_consume(in, len + 1);
    }
    if (got == 0 || got < 0) r->stopping = 1;
}

/* ---- the loop -------------------------------------------------------------------------------- */
static void expire_connects(relay *r) {
    double now = now_s();
    for (upstream *u = r->connecting, *next; u != NULL; u = next) {
        next = u->next;
        if (u->deadline <= now && u->exchange != NULL) worker_failed(r, u->exchange, "cannot connect: timed out");
    }
}

static int next_timeout_ms(relay *r) {
    if (r->connecting == NULL && r->accept_resumes == 0) return 1000;
    double soonest = r->accept_resumes ? r->accept_resumes : r->connecting->deadline;
    for (upstream *u = r->connecting; u != NULL; u = u->next)
        if (u->deadline < soonest) soonest = u->deadline;
    double wait = (soonest - now_s()) * 1000.0;
    return wait <= 0 ? 0 : (int)wait + 1;
}

static void handle_event(relay *r, conn *c, uint32_t events) {
    if (c->fd < 0) return;
    switch (c->kind) {
    case LISTENER:
        accept_clients(r);
        break;
    case CONTROL:
        if (events & EPOLLOUT) conn_flush(r, c);
        if (events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) control_readable(r);
        break;
    case CLIENT: {
        client *cl = (client *)c;
        if ((events & EPOLLOUT) && client_flush(r, cl) != 0) break;
        if (events & EPOLLOUT && cl->exchange && cl->exchange->upstream &&
            buf_len(&cl->c.out) <= CLIENT_OUT_HIGH / 2) {
            upstream *u = cl->exchange->upstream;
            watch(r, &u->c, u->c.events | EPOLLIN | EPOLLRDHUP);
        }
        if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) client_readable(r, cl, events);
        break;
    }
    case UPSTREAM: {
        upstream *u = (upstream *)c;
        if (u->connecting) upstream_connected(r, u);
        else if ((events & EPOLLOUT) && conn_flush(r, c) != 0 && u->exchange && !retry_on_fresh(r, u->exchange))
            worker_failed(r, u->exchange, "connection lost");
        else if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) upstream_readable(r, u);
        break;
    }
    }
}

static void resolve_workers(relay *r) {
    int n = r->config->num_workers;
    for (int i = 0; i <= n; i++) {
        worker *w = &r->workers[i];
        char port[16];
        snprintf(port, sizeof port, "%d", r->config->ports[i]);
        const char *credentials = i < n && r->config->worker_credentials ? r->config->worker_credentials : "";
        if (asprintf(&w->host_header, "host: %s:%d\r\n%s", r->config->hosts[i], r->config->ports[i], credentials) < 0)
            w->host_header = NULL; /* request_bytes refuses: out of memory */
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *found = NULL;
        if (getaddrinfo(r->config->hosts[i], port, &hints, &found) == 0 && found != NULL) {
            memcpy(&w->address, found->ai_addr, found->ai_addrlen);
            w->address_len = found->ai_addrlen;
            w->resolved = 1;
        }
        if (found) freeaddrinfo(found);
    }
}

static void shut_down(relay *r) {
    while (r->clients != NULL) client_close(r, r->clients);
    for (int i = 0; i <= r->config->num_workers; i++) {
        while (r->workers[i].idle != NULL) upstream_close(r, r->workers[i].idle);
        free(r->workers[i].host_header);
    }
    while (r->connecting != NULL) upstream_close(r, r->connecting);
    free_retired(r);
    buf_free(&r->control.in);
    buf_free(&r->control.out);
    free(r->workers);
    close(r->epoll_fd);
}

/* Run the data plane until the control socket closes. 0, or -1 if it could not start. */
int relay_run(const struct relay_config *config) {
    relay r = {.config = config};
    r.workers = calloc((size_t)config->num_workers + 1, sizeof *r.workers);
    r.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    r.listener = (conn){.kind = LISTENER, .fd = config->listen_fd};
    r.control = (conn){.kind = CONTROL, .fd = config->control_fd};
    if (r.workers == NULL || r.epoll_fd < 0 || watch(&r, &r.listener, EPOLLIN) != 0 ||
        watch(&r, &r.control, EPOLLIN | EPOLLRDHUP) != 0) {
        free(r.workers);
        if (r.epoll_fd >= 0) close(r.epoll_fd);
        return -1;
    }
    resolve_workers(&r);
    struct epoll_event events[64];
    while (!r.stopping) {
        int n = epoll_wait(r.epoll_fd, events, 64, next_timeout_ms(&r));
        for (int i = 0; i < n; i++) handle_event(&r, events[i].data.ptr, events[i].events);
        if (r.connecting != NULL) expire_connects(&r);
        if (r.accept_resumes && now_s() >= r.accept_resumes && watch(&r, &r.listener, EPOLLIN) == 0) r.accept_resumes = 0;
        free_retired(&r);
    }
    epoll_ctl(r.epoll_fd, EPOLL_CTL_DEL, config->listen_fd, NULL);
    epoll_ctl(r.epoll_fd, EPOLL_CTL_DEL, config->control_fd, NULL);
    shut_down(&r);
    return 0;
}
