#!/usr/bin/perl
# The ledger's service: a small HTTP server over build/balances.txt.
#   GET /health             -> ok
#   GET /accounts           -> one account a line
#   GET /balance/<account>  -> its balance, or 404
use strict;
use warnings;
use IO::Socket::INET;

my $port = $ENV{LEDGER_PORT} || 8080;
my $server = IO::Socket::INET->new(LocalAddr => "127.0.0.1", LocalPort => $port, Listen => 16, ReuseAddr => 1)
    or die "serve.pl: cannot listen on 127.0.0.1:$port: $!\n";
$| = 1;
print "serve.pl: listening on 127.0.0.1:$port\n";
while (my $client = $server->accept) {
    my $request = <$client>;
    next unless defined $request;
    while (my $line = <$client>) { last if $line =~ /^\r?\n$/ }
    my ($status, $body) = respond($request);
    print $client "HTTP/1.0 $status\r\nContent-Type: text/plain\r\nContent-Length: " . length($body)
        . "\r\nConnection: close\r\n\r\n$body";
    close $client;
}

sub respond {
    my ($request) = @_;
    my ($method, $path) = $request =~ m{^(\S+) (\S+)} or return ("400 Bad Request", "bad request\n");
    return ("405 Method Not Allowed", "GET only\n") if $method ne "GET";
    return ("200 OK", "ok\n") if $path eq "/health";
    my %balances = balances();
    return ("200 OK", join("", map {"$_\n"} sort keys %balances)) if $path eq "/accounts";
    if ($path =~ m{^/balance/([a-z0-9-]+)$}) {
        return ("200 OK", "$balances{$1}\n") if exists $balances{$1};
        return ("404 Not Found", "no account $1\n");
    }
    return ("404 Not Found", "no route $path\n");
}

sub balances {
    open(my $file, "<", "build/balances.txt") or return ();
    my %found;
    while (<$file>) {
        my ($account, $count, $balance) = split;
        $found{$account} = $balance;
    }
    return %found;
}
